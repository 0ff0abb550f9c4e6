# SPDX-License-Identifier: GPL-3.0-or-later
"""diffusion-pipe's run folder, on request (``run_layout = "diffusion-pipe"``), beside PipeTrain's own files.

diffusion-pipe users' scripts read each save as ``<run>/epochN/adapter_model.safetensors`` (``stepN/`` for a save
every N steps) with a PEFT ``adapter_config.json`` and the config beside it, and find checkpoints as
``<run>/global_stepN/``. With the layout on, rank 0 writes each epoch or step LoRA there too (the same file as the
one in ``loras/``, whose keys, ``diffusion_model.<module>.lora_A.weight``, are the ones diffusion-pipe saves for
ComfyUI's models) and links ``global_stepN`` to each checkpoint. Its signal files are read whatever the layout:
``save`` in the run folder asks for a checkpoint now, ``save_quit`` for a checkpoint and a stop (the ``stop`` file's
meaning); each is removed once taken."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..fsutil import atomic_write_bytes, temp_path_beside

LAYOUT = "diffusion-pipe"
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
SAVE, SAVE_QUIT = "save", "save_quit"
PEFT_TYPES = {"lora": "LORA", "lokr": "LOKR", "loha": "LOHA", "oft": "OFT"}


def save_name(epoch: int, step: int, at_step: bool) -> str:
    return f"step{step}" if at_step else f"epoch{epoch}"


def write_save(run_dir: Path, name: str, lora_file: Path, adapter: dict, config_name: str, run_toml: str) -> Path:
    """``<run_dir>/<name>/``: the LoRA as adapter_model.safetensors, its PEFT adapter_config.json and the config;
    each file replaced whole (a resumed run writes an epoch again)."""
    folder = run_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / ADAPTER_FILE
    temp = temp_path_beside(target)
    temp.unlink()
    try:
        os.link(lora_file, temp)   # the same bytes, no second copy on disk
    except OSError:
        shutil.copyfile(lora_file, temp)
    os.replace(temp, target)
    atomic_write_bytes(folder / ADAPTER_CONFIG, json.dumps(peft_config(adapter), indent=2).encode())
    atomic_write_bytes(folder / config_name, run_toml.encode())
    return target


def peft_config(adapter: dict) -> dict:
    """The keys of PEFT's adapter_config.json that diffusion-pipe's saves carry (alpha = rank there)."""
    return {"peft_type": PEFT_TYPES.get(adapter["type"], adapter["type"].upper()), "r": adapter["rank"],
            "lora_alpha": adapter["alpha"], "lora_dropout": adapter["dropout"],
            "target_modules": adapter["target_modules"] or adapter["target_blocks"], "base_model_name_or_path": None,
            "task_type": None, "bias": "none"}


def link_checkpoint(run_dir: Path, step: int, checkpoint: Path) -> None:
    """``<run_dir>/global_step<step>`` -> the checkpoint folder (relative, so a moved run keeps it); links whose
    checkpoint was pruned since are removed."""
    for old in run_dir.glob("global_step*"):
        if old.is_symlink() and not old.exists():
            old.unlink()
    link = run_dir / f"global_step{step}"
    if link.is_symlink() or not link.exists():
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(checkpoint, run_dir))


def take_signals(run_dir) -> bool:
    """diffusion-pipe's signal files (rank 0): ``save_quit`` becomes the stop file; whether ``save`` asks for a
    checkpoint now. Each is removed once taken."""
    path = run_dir.path
    if (path / SAVE_QUIT).exists():
        (path / SAVE_QUIT).unlink(missing_ok=True)
        run_dir.request_stop()
    if (path / SAVE).exists():
        (path / SAVE).unlink(missing_ok=True)
        return True
    return False
