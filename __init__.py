"""PipeTrain: train diffusion-model LoRAs from ComfyUI with DeepSpeed pipeline parallelism.

Imported by ComfyUI as a custom node pack (``comfy_entrypoint``) and as the ``pipetrain`` package by
the headless CLI. Importing this module is cheap: ComfyUI's APIs load only when ComfyUI asks for nodes.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .launcher.comfy import install
    from .nodes import PipeTrainExtension

    install()  # /pipetrain routes, re-attach to live runs, event relay
    return PipeTrainExtension()
