# SPDX-License-Identifier: GPL-3.0-or-later
"""The launcher inside a running ComfyUI: its folders, the process-wide ``Launcher``, the relay and
the routes. Imported only by ComfyUI (``comfy_entrypoint``) and the nodes, never by the backend.

Runs live in ``<output>/pipetrain/<run_id>/``; epoch LoRAs in ``<models/loras>/pipetrain/<run_id>/`` so
that ComfyUI's LoRA loaders list them.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from .core import Launcher
from .relay import EventRelay

log = logging.getLogger("pipetrain")
_lock = threading.Lock()
_launcher: Launcher | None = None
_relay: EventRelay | None = None


def runs_root() -> Path:
    import folder_paths
    return Path(folder_paths.get_output_directory()) / "pipetrain"


def lora_root() -> Path:
    import folder_paths
    return Path(folder_paths.get_folder_paths("loras")[0]) / "pipetrain"


def comfyui_root() -> Path:
    import folder_paths
    return Path(folder_paths.__file__).resolve().parent


def free_models(devices: tuple[int, ...]) -> None:
    """Unload ComfyUI's models when the run will use the GPU ComfyUI computes on."""
    import comfy.model_management as mm
    device = mm.get_torch_device()
    if device.type == "cuda" and (device.index or 0) not in devices:
        return
    mm.unload_all_models()
    mm.soft_empty_cache()
    log.info("pipetrain: unloaded ComfyUI's models before starting a run on GPU(s) %s", list(devices))


def get_launcher() -> Launcher:
    global _launcher
    with _lock:
        if _launcher is None:
            _launcher = Launcher(runs_root(), lora_root=lora_root(), comfyui_root=comfyui_root(),
                                 before_launch=free_models)
            live = list(_launcher.procs)
            if live:
                log.info("pipetrain: re-attached to running run(s): %s", ", ".join(live))
        return _launcher


def install() -> None:
    """Register the routes and start the event relay (once per ComfyUI process)."""
    global _relay
    from server import PromptServer

    from .routes import add_routes

    if _relay is not None:
        return
    server = PromptServer.instance
    add_routes(server.routes, get_launcher)
    _relay = EventRelay(get_launcher(), server.send_sync).start()
