"""PipeTrain's training backend: runs headless and inside the detached DeepSpeed process.

Never imports ComfyUI's server or PipeTrain's launcher.
"""
