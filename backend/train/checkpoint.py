"""Training-state checkpoints: DeepSpeed's own (LoRA weights, optimizer, LR schedule) plus our position
in the data and every rank's RNG state. A checkpoint is written under a temporary name, marked complete
(``pipetrain.json``) and renamed only once every rank has finished, so a final name never holds a partial
checkpoint; a checkpoint of the same step already there is moved aside, not deleted, until its
replacement is in place."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..fsutil import OutOfSpace, atomic_write_bytes, fault_point, space_guard
from . import distributed

LATEST = "latest"
COMPLETE = "pipetrain.json"   # our client state, written last into the temporary folder
PARTIAL, ASIDE = ".partial-", ".old-"

log = logging.getLogger("pipetrain")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE).is_file()


def save(engine, ckpt_root: Path, step: int, client_state: dict, extra=None) -> Path:
    """``extra(folder)``: called on every rank to write its own files into the checkpoint (``ema``)."""
    tag = tag_for(step)
    partial, final, aside = ckpt_root / f"{PARTIAL}{tag}", ckpt_root / tag, ckpt_root / f"{ASIDE}{tag}"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    check_room(engine, ckpt_root)   # every rank, in step (a barrier too): all refuse before any writes
    # a full disk leaves no partial folder behind; the folder is every rank's, so rank 0 alone removes it: another
    # rank that runs out of space first would pull it from under rank 0's write (a traceback, not the full disk)
    with space_guard(ckpt_root, *([partial] if rank == 0 else [])):
        engine.save_checkpoint(str(ckpt_root), tag=partial.name, client_state=client_state, save_latest=False,
                               exclude_frozen_parameters=True)
        torch.save({"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
                   partial / f"rng_rank{rank:05d}.pt")
        if extra is not None:
            extra(partial)
        distributed.barrier()
        if rank == 0:
            atomic_write_bytes(partial / COMPLETE, json.dumps(client_state).encode())
            fault_point("checkpoint-written")
            if final.exists():   # the same step again after a resume from an older checkpoint
                shutil.rmtree(aside, ignore_errors=True)
                final.rename(aside)
                fault_point("checkpoint-aside")
            partial.rename(final)
            fault_point("checkpoint-renamed")
            atomic_write_bytes(ckpt_root / LATEST, tag.encode())
            fault_point("checkpoint-latest")
            shutil.rmtree(aside, ignore_errors=True)
    distributed.barrier()
    return final


def state_bytes(engine) -> int:
    """The least this rank's part of a checkpoint takes: its trained weights and their optimizer state."""
    trained = sum(p.nbytes for p in engine.module.parameters() if p.requires_grad)
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)   # DeepSpeed's wrappers hold torch's
    states = getattr(optimizer, "state", {}).values()
    return trained + sum(t.nbytes for state in states for t in state.values() if torch.is_tensor(t))


def check_room(engine, ckpt_root: Path) -> None:
    """``OutOfSpace`` on every rank where the checkpoint folder's disk cannot hold all ranks' parts (the folder is
    shared). Refused before anything is written: a disk that fills during the writes leaves one rank failing while
    the others still write into the folder it would have to remove."""
    needed = sum(distributed.all_gather_object(state_bytes(engine)))
    if shutil.disk_usage(ckpt_root).free < needed:
        raise OutOfSpace(ckpt_root)


def latest_tag(ckpt_root: Path) -> str | None:
    """The checkpoint ``latest`` names, or where that one is missing or incomplete (a run killed while
    saving), the newest complete one."""
    try:
        tag = (ckpt_root / LATEST).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        tag = None
    if tag and is_complete(ckpt_root / tag):
        return tag
    complete = sorted(p.name for p in ckpt_root.glob("step*") if is_complete(p))
    if complete and tag:
        log.warning("%s names checkpoint %s, which is missing or incomplete: using %s, the newest complete one",
                    ckpt_root / LATEST, tag, complete[-1])
    return complete[-1] if complete else None


def sweep(ckpt_root: Path) -> None:
    """What a killed save left: temporary folders go; a checkpoint moved aside for its replacement comes back
    when the replacement never arrived."""
    if not ckpt_root.is_dir():
        return
    for path in ckpt_root.glob(f"{PARTIAL}*"):
        shutil.rmtree(path, ignore_errors=True)
    for path in ckpt_root.glob(f"{ASIDE}*"):
        final = ckpt_root / path.name[len(ASIDE):]
        if is_complete(final):
            shutil.rmtree(path, ignore_errors=True)
        else:
            shutil.rmtree(final, ignore_errors=True)
            path.rename(final)


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
