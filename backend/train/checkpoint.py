"""Training-state checkpoints: DeepSpeed's own (LoRA weights, optimizer, LR schedule) plus our position
in the data and every rank's RNG state. A checkpoint is written under a temporary name and renamed
only once every rank has finished, so a final name never holds a partial checkpoint."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..fsutil import atomic_write_bytes
from . import distributed

LATEST = "latest"


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def save(engine, ckpt_root: Path, step: int, client_state: dict) -> Path:
    tag = tag_for(step)
    partial = f".partial-{tag}"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(ckpt_root / partial, ignore_errors=True)
    distributed.barrier()
    engine.save_checkpoint(str(ckpt_root), tag=partial, client_state=client_state, save_latest=False,
                           exclude_frozen_parameters=True)
    torch.save({"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
               ckpt_root / partial / f"rng_rank{rank:05d}.pt")
    distributed.barrier()
    final = ckpt_root / tag
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        (ckpt_root / partial).rename(final)
        atomic_write_bytes(ckpt_root / LATEST, tag.encode())
        atomic_write_bytes(final / "pipetrain.json", json.dumps(client_state).encode())
    distributed.barrier()
    return final


def latest_tag(ckpt_root: Path) -> str | None:
    try:
        tag = (ckpt_root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    return tag if (ckpt_root / tag).is_dir() else None


def load(engine, ckpt_root: Path, tag: str) -> dict:
    _, client_state = engine.load_checkpoint(str(ckpt_root), tag=tag, load_module_strict=False,
                                             load_optimizer_states=True, load_lr_scheduler_states=True)
    rng = ckpt_root / tag / f"rng_rank{dist.get_rank():05d}.pt"
    if rng.is_file():
        state = torch.load(rng, weights_only=False)
        torch.set_rng_state(state["torch"])
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
    return client_state or {}
