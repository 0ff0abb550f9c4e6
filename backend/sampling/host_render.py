"""The files between a run and the ComfyUI that renders its epoch samples (``[samples] render = "host"``).

After saving an epoch LoRA, global rank 0 writes a *request* ``<run dir>/sample_requests/<LoRA stem>.json``
(and a ``sample_request`` event) and waits. Whoever renders the prompts (ComfyUI's "PipeTrain Epoch Samples"
node, or ``python -m pipetrain sample``) writes the PNGs beside the LoRA and then the *marker*
``<LoRA stem>.samples.json`` beside them: ``{"pngs": [...]}`` or ``{"error": "..."}``, plus who rendered
them (``renderer``, ``pid``). A request without a marker is *pending*; the run removes a request once it
has announced its samples (or rendered them itself), so a pending request outlives only a run stopped or
killed while it waited, and a restarted ComfyUI renders it then. No torch, no ComfyUI: the launcher reads
these files too.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from ..fsutil import atomic_write_json
from ..run.folder import RunDir
from ..run.folder import read_object

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def marker_path(lora: Path) -> Path:
    lora = Path(lora)
    return lora.with_name(f"{lora.with_suffix('').name}.samples.json")


def request_path(run_dir: Path | RunDir, lora: Path) -> Path:
    return RunDir(run_dir).sample_requests / f"{Path(lora).with_suffix('').name}.json"


def write_request(run_dir: Path, lora: Path, epoch: int, step: int) -> dict:
    """The request for ``lora``'s samples; returns its content (``request`` = the file)."""
    path = request_path(run_dir, lora)
    request = {"run_toml": str(RunDir(run_dir).run_toml), "lora": str(lora), "epoch": epoch, "step": step,
               "marker": str(marker_path(lora)), "time": time.time()}
    atomic_write_json(path, request)
    return request | {"request": str(path)}


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path`` (a regular file of bounded size), or None."""
    return read_object(Path(path))


def read_request(path: Path) -> dict:
    request = read_json(path)
    if request is None or not isinstance(request.get("lora"), str) or not isinstance(request.get("run_toml"), str):
        raise FileNotFoundError(f"no readable sample request at {path}")
    return request


def read_marker(lora: Path) -> dict | None:
    return read_json(marker_path(lora))


def write_marker(lora: Path, *, renderer: str, pngs: list[Path] | None = None, error: str | None = None) -> dict:
    marker = {"pngs": [str(p) for p in pngs or []], "error": error, "renderer": renderer, "pid": os.getpid(),
              "time": time.time()}
    atomic_write_json(marker_path(lora), marker)
    return marker


def requests(run_dir: Path | RunDir) -> list[Path]:
    folder = RunDir(run_dir).sample_requests
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def pending(run_dir: Path) -> list[Path]:
    """Requests of ``run_dir`` that no renderer has answered yet."""
    out = []
    for path in requests(run_dir):
        request = read_json(path)
        if request and isinstance(request.get("lora"), str) and read_marker(Path(request["lora"])) is None:
            out.append(path)
    return out


def withdraw(run_dir: Path, lora: Path) -> None:
    request_path(run_dir, lora).unlink(missing_ok=True)
