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
from .samples import SAMPLES_NODE, SampleHost

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
    _guard_runs_folder(server.app)
    host = SampleHost(get_launcher().dirs, queue_prompt)
    _relay = EventRelay(get_launcher(), server.send_sync, sample_host=host).start()


def _guard_runs_folder(app) -> None:
    """ComfyUI's file routes serve and write ``output/``; never the runs folder (``runs_guard.py``)."""
    import folder_paths

    from .runs_guard import runs_folder_guard

    try:     # custom nodes load before the server starts, while middlewares can still be added
        app.middlewares.append(runs_folder_guard(lambda: [runs_root()], folder_paths.get_directory_by_type))
    except RuntimeError:
        log.warning("pipetrain: could not guard the runs folder from ComfyUI's file routes (the server had started)")


def queue_prompt(graph: dict, timeout: float = 60.0) -> str | None:
    """Put ``graph`` on ComfyUI's queue as its ``POST /prompt`` does (validated, numbered, then
    ``prompt_queue.put``), on the server's event loop; None while ComfyUI is still loading nodes."""
    import asyncio
    import time
    import uuid

    import execution
    import nodes
    from server import PromptServer

    if SAMPLES_NODE not in nodes.NODE_CLASS_MAPPINGS:
        return None
    server = PromptServer.instance

    async def put() -> str:
        prompt_id = str(uuid.uuid4())
        valid = await execution.validate_prompt(prompt_id, graph, None)
        if not valid[0]:
            raise RuntimeError(f"ComfyUI rejected the sampling prompt: {valid[1]} {valid[3]}")
        number = server.number
        server.number += 1
        extra_data = {"create_time": int(time.time() * 1000)}
        server.prompt_queue.put((number, prompt_id, graph, extra_data, valid[2], {}))
        return prompt_id

    future = asyncio.run_coroutine_threadsafe(put(), server.loop)
    try:
        return future.result(timeout)
    except TimeoutError:       # the event loop is not running yet (start-up): try again next tick
        future.cancel()
        return None
