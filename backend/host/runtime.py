"""Locate and import ComfyUI. The only module in PipeTrain that changes ``sys.path``.

Search order: a ComfyUI already imported in this process; the CLI's ``--comfyui`` (``use_comfyui``, which sets
``COMFYUI_PATH`` for the processes a command starts); ``COMFYUI_PATH``; the ComfyUI whose ``custom_nodes/`` holds
this package; the ComfyUI folder holding this Python's virtual environment (``ComfyUI/venv``, as a
``pip install .`` into ComfyUI's own environment leaves it); the current folder or the ComfyUI above it (run from
``ComfyUI/`` or ``ComfyUI/custom_nodes/<x>``); the pinned headless copy that ``scripts/setup.sh`` installs at
``.comfyui/ComfyUI``. ``found_comfyui`` says in one sentence which was found, and how.
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


_flag: Path | None = None    # the CLI's --comfyui


def use_comfyui(path: str) -> None:
    """The CLI's ``--comfyui PATH``: first in the search, and ``COMFYUI_PATH`` for the processes a command starts
    (DeepSpeed's ranks)."""
    global _flag
    _flag = Path(path).expanduser().resolve()
    os.environ["COMFYUI_PATH"] = str(_flag)


def _candidates() -> list[tuple[str, Path]]:
    found = []
    if _flag is not None:
        found.append(("--comfyui", _flag))
    env = os.environ.get("COMFYUI_PATH")
    if env and (_flag is None or Path(env).expanduser().resolve() != _flag):
        found.append(("COMFYUI_PATH", Path(env).expanduser()))
    if REPO_ROOT.parent.name == "custom_nodes":
        found.append(("the ComfyUI this package sits in (custom_nodes/)", REPO_ROOT.parent.parent))
    if sys.prefix != sys.base_prefix:
        found.append(("the ComfyUI holding this Python's environment", Path(sys.prefix).parent))
    cwd = Path.cwd()
    found.append(("the current folder", cwd))
    if cwd.parent.name == "custom_nodes":
        found.append(("the ComfyUI above the current folder", cwd.parent.parent))
    found.append(("the pinned headless copy", PINNED_COMFYUI))
    return found


def is_comfyui(path: Path) -> bool:
    return (path / "comfy" / "model_management.py").is_file()


def _locate() -> tuple[Path, str]:
    imported = _already_imported()
    if imported is not None:
        return imported, "the ComfyUI already imported"
    tried = []
    for origin, path in _candidates():
        if is_comfyui(path):
            return path.resolve(), origin
        tried.append(f"{origin}: {path}")
    if _flag is not None or os.environ.get("COMFYUI_PATH"):
        given = _flag or Path(os.environ["COMFYUI_PATH"]).expanduser()
        raise RuntimeSetupError(f"ComfyUI not found at {given}: a ComfyUI folder holds comfy/model_management.py "
                                "(give the folder with main.py)")
    raise RuntimeSetupError(
        "ComfyUI not found. Tried " + "; ".join(tried)
        + ". Pass --comfyui PATH or set COMFYUI_PATH to your ComfyUI folder (the one with main.py), or install "
        "PipeTrain into ComfyUI/custom_nodes/ (a clone of the repository: scripts/setup.sh installs a pinned copy)"
    )


def locate_comfyui() -> Path:
    """Return ComfyUI's root folder without importing it."""
    return _locate()[0]


def found_comfyui() -> str:
    """One sentence: which ComfyUI a command uses and how it was found (``RuntimeSetupError`` where none)."""
    path, origin = _locate()
    return f"using the ComfyUI at {path} (found through {origin})"


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
