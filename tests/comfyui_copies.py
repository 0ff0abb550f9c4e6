"""Other ComfyUIs for the tests: the extra versions scripts/setup.sh extracts beside the pinned one
(``.comfyui/ComfyUI-<version>``), and temporary copies of a ComfyUI with one line of its model code changed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def other_comfyuis() -> dict[str, Path]:
    """version -> folder of every ComfyUI beside the pinned one (``.comfyui/ComfyUI-<version>``)."""
    return {p.name.removeprefix("ComfyUI-"): p for p in sorted((REPO / ".comfyui").glob("ComfyUI-*"))
            if (p / "comfy" / "model_management.py").is_file()}


def planted_copy(source: Path, dest: Path, file: str, old: str, new: str, occurrences: int = 1) -> Path:
    """``source`` with ``comfy/`` copied (everything else linked) and ``old`` replaced by ``new`` in ``file``
    (where it occurs exactly ``occurrences`` times)."""
    import shutil

    dest.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.name == "comfy":
            shutil.copytree(entry, dest / "comfy", ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / entry.name).symlink_to(entry.resolve())
    target = dest / file
    text = target.read_text()
    assert text.count(old) == occurrences, f"{file} changed upstream: the planted line is not there as expected"
    target.write_text(text.replace(old, new))
    return dest


def python_env(comfyui: Path, **extra: str) -> dict:
    """The environment of a child process that imports ``comfyui`` (and this checkout as ``pipetrain``)."""
    return {**os.environ, "COMFYUI_PATH": str(comfyui), "PYTHONUNBUFFERED": "1", **extra}


def doctor(comfyui: Path, *model_types: str, timeout: float = 600, **env: str) -> dict:
    """``python -m pipetrain doctor --json`` on ``comfyui`` in a child process (ComfyUI imports once per process)."""
    argv = [sys.executable, "-m", "pipetrain", "doctor", "--json", "--comfyui", str(comfyui)]
    for t in model_types:
        argv += ["--model-type", t]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=python_env(comfyui, **env))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
