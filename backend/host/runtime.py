"""Locate and import ComfyUI. The only module in PipeTrain that changes ``sys.path``.

Search order: a ComfyUI already imported in this process; ``COMFYUI_PATH``; the ComfyUI whose
``custom_nodes/`` holds this repository; the pinned headless copy that ``scripts/setup.sh`` installs
at ``.comfyui/ComfyUI``.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

from ..errors import RuntimeSetupError

REPO_ROOT = Path(__file__).resolve().parents[2]
PINNED_COMFYUI = REPO_ROOT / ".comfyui" / "ComfyUI"
PINNED_VERSION = "0.3.75"

_root: Path | None = None


def _already_imported() -> Path | None:
    mod = sys.modules.get("comfy")
    if mod is None or not getattr(mod, "__path__", None):
        return None
    return Path(list(mod.__path__)[0]).resolve().parent


def _candidates() -> list[tuple[str, Path]]:
    found = []
    env = os.environ.get("COMFYUI_PATH")
    if env:
        found.append(("COMFYUI_PATH", Path(env).expanduser()))
    if REPO_ROOT.parent.name == "custom_nodes":
        found.append(("the ComfyUI holding custom_nodes/", REPO_ROOT.parent.parent))
    found.append(("the pinned headless copy", PINNED_COMFYUI))
    return found


def locate_comfyui() -> Path:
    """Return ComfyUI's root folder without importing it."""
    imported = _already_imported()
    if imported is not None:
        return imported
    tried = []
    for origin, path in _candidates():
        if (path / "comfy" / "model_management.py").is_file():
            return path.resolve()
        tried.append(f"{origin}: {path}")
    raise RuntimeSetupError(
        "ComfyUI not found. Tried " + "; ".join(tried)
        + ". Set COMFYUI_PATH to a ComfyUI folder, or run scripts/setup.sh to install the pinned copy."
    )


def ensure_comfyui(cpu: bool | None = None) -> Path:
    """Import ComfyUI as a library (argument parsing off) and return its root.

    ``cpu`` forces ComfyUI's CPU mode; by default it is on when torch sees no CUDA device.
    Must run before any ``comfy.model_management`` import, which picks the device at import time.
    """
    global _root
    if _root is not None:
        return _root
    root = locate_comfyui()
    if _already_imported() is None:
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        import torch
        import comfy.options
        comfy.options.enable_args_parsing(False)
        import comfy.cli_args
        if cpu is None:
            cpu = not torch.cuda.is_available()
        if cpu:
            comfy.cli_args.args.cpu = True
    import comfy.model_management  # noqa: F401  (decides the device)
    _root = root
    return root


def comfy_nodes():
    """ComfyUI's own ``nodes`` module (LoraLoaderModelOnly & co.), even where another top-level ``nodes``
    package (e.g. this repository's, when its root is on ``sys.path``) would shadow it."""
    import importlib.util

    loaded = sys.modules.get("nodes")
    if loaded is not None and hasattr(loaded, "LoraLoaderModelOnly"):
        return loaded
    root = ensure_comfyui()
    spec = importlib.util.spec_from_file_location("nodes", root / "nodes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["nodes"] = module
    spec.loader.exec_module(module)
    return module


def comfyui_version() -> str:
    from .versions import read_version

    return read_version(ensure_comfyui())


@contextmanager
def comfy_training_paths(on: bool = True):
    """While inside, ComfyUI's model code takes its training paths (``on``) or its inference paths.

    ComfyUI (from 0.8) reads ``comfy.model_management.in_training`` at call time: while it is true its model
    code runs eager, autograd-safe code (RoPE without the fused inference kernel, out-of-place residuals, no fused
    SwiGLU) that computes the same maths. Older ComfyUIs have no such flag and ignore it. Where ComfyUI calls a
    comfy-kitchen kernel on every path, training takes comfy-kitchen's eager backend (``patches_comfyui.
    kitchen_eager``), and where ComfyUI orders the SDPA backends for inference, training orders them for training
    (``patches_comfyui.training_attention_priority``).
    """
    ensure_comfyui()
    import comfy.model_management as mm

    from .patches_comfyui import kitchen_eager, training_attention_priority

    before = getattr(mm, "in_training", _ABSENT)
    mm.in_training = on
    try:
        with kitchen_eager() if on else nullcontext(), training_attention_priority() if on else nullcontext():
            yield
    finally:
        if before is _ABSENT:
            del mm.in_training
        else:
            mm.in_training = before


_ABSENT = object()
