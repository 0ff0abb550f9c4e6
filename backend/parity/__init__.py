"""Which ComfyUI trains a run (the host's or the pinned copy), and the proof: our training layers compared with
the ComfyUI's own model code, and a saved LoRA loaded by its own loader."""
