"""Training-state checkpoints: DeepSpeed's own (LoRA weights, optimizer, LR schedule) plus our position
in the data and every rank's RNG state. A checkpoint is written under a temporary name, marked complete
(``pipetrain.json``) and renamed only once every rank has finished, so a final name never holds a partial
checkpoint; a checkpoint of the same step already there is moved aside, not deleted, until its
replacement is in place. Every file's SHA-256 (``digests.json``, written before the completion mark) is checked
before a resume loads it: a damaged or cut checkpoint is passed over for the previous one that checks out. Nothing
in a checkpoint is unpickled beyond tensors and plain values (``patches_deepspeed.load_checkpoints_weights_only``;
our RNG states are safetensors)."""
from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError
from ..fsutil import (OutOfSpace, UnreadableFile, atomic_write_bytes, atomic_write_json, fault_point,
                      read_regular, space_guard)
from .patches_deepspeed import load_checkpoints_weights_only, load_weights_only
from . import distributed

LATEST = "latest"
COMPLETE = "pipetrain.json"   # our client state, written last into the temporary folder
DIGESTS = "digests.json"      # every other file's size and SHA-256, written just before COMPLETE
PARTIAL, ASIDE = ".partial-", ".old-"
TAG = re.compile(r"step\d+")   # the only names a checkpoint folder (and so ``latest``) may have

log = logging.getLogger("pipetrain")


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE).is_file()


def rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng_rank{rank:05d}.safetensors"


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
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        save_file(rng, str(rng_file(partial, rank)))
        if extra is not None:
            extra(partial)
        distributed.barrier()
        digests = _gathered(lambda names: {name: _digest(partial / name) for name in names}, _listed_files(partial))
        if rank == 0:
            atomic_write_json(partial / DIGESTS, digests)
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


def _named_by_latest(ckpt_root: Path) -> str | None:
    """The tag ``latest`` names, when it names a checkpoint folder of this run: anything else (a path, ``..``, an
    absolute name) is refused with a warning (the file's content is not quoted)."""
    try:   # a regular file of a line: a FIFO or a device put in its place is not read
        tag = read_regular(ckpt_root / LATEST, 4096).decode(errors="replace").strip()
    except UnreadableFile:   # missing, or no file of a line: the newest complete checkpoint is taken
        return None
    if TAG.fullmatch(tag):
        return tag
    log.warning("%s does not name a checkpoint folder of this run (step and digits): ignored", ckpt_root / LATEST)
    return None


def _is_checkpoint(folder: Path) -> bool:
    """A complete checkpoint folder inside its run: a link (which could lead anywhere) is none."""
    return TAG.fullmatch(folder.name) is not None and not folder.is_symlink() and is_complete(folder)


def _complete_tags(ckpt_root: Path) -> list[str]:
    return sorted(p.name for p in ckpt_root.glob("step*") if _is_checkpoint(p))


def latest_tag(ckpt_root: Path) -> str | None:
    """The checkpoint ``latest`` names, or where that one is missing or incomplete (a run killed while
    saving), the newest complete one. Reads no checkpoint file (``resume_tag`` also checks them)."""
    tag = _named_by_latest(ckpt_root)
    if tag and _is_checkpoint(ckpt_root / tag):
        return tag
    complete = _complete_tags(ckpt_root)
    if complete and tag:
        log.warning("%s names checkpoint %s, which is missing or incomplete: using %s, the newest complete one",
                    ckpt_root / LATEST, tag, complete[-1])
    return complete[-1] if complete else None


def _candidates(ckpt_root: Path) -> list[str]:
    """Resume's order: what ``latest_tag`` picks, then the other complete checkpoints, newest first."""
    first = latest_tag(ckpt_root)
    return ([first] if first else []) + [t for t in reversed(_complete_tags(ckpt_root)) if t != first]


def resume_tag(ckpt_root: Path) -> tuple[str | None, list[tuple[str, str]]]:
    """The checkpoint a resume loads: the first of ``_candidates`` whose files all match their digests (every rank
    checks a share of them), and each one passed over with what is wrong with it. Collective: every rank."""
    skipped = []
    for tag in distributed.broadcast_object(_candidates(ckpt_root)):
        problems = [p for p in _gathered(lambda names: _check(ckpt_root / tag, names), _expected(ckpt_root / tag))
                    if p]
        if not problems:
            return tag, skipped
        skipped.append((tag, problems[0]))
    return None, skipped


def verify(folder: Path) -> str | None:
    """What is wrong with a complete checkpoint's files (missing, cut, changed, unlisted), or None."""
    problems = _check(folder, _expected(folder))
    return problems[0] if problems else None


def _listed_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name not in (DIGESTS, COMPLETE))


def _digest(path: Path) -> dict:
    with open(path, "rb") as f:
        return {"bytes": path.stat().st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _gathered(work, names: list[str]) -> list:
    """``work`` over this rank's share of ``names``, every rank's results together (a dict merged, else a list)."""
    share = names[dist.get_rank()::dist.get_world_size()] if dist.is_initialized() else names
    results = distributed.all_gather_object(work(share))
    if all(isinstance(r, dict) for r in results):
        return {k: v for r in results for k, v in r.items()}
    return [p for r in results for p in r]


def _expected(folder: Path) -> list[tuple[str, dict | None]]:
    """Each file the checkpoint holds or its digests name, with its recorded digest (None: unlisted). A checkpoint
    saved before digests were written lists none and is not checked."""
    try:
        digests = json.loads((folder / DIGESTS).read_text())
    except FileNotFoundError:
        log.warning("checkpoint %s has no %s (saved by an older PipeTrain): its files are not checked", folder,
                    DIGESTS)
        return []
    except (OSError, ValueError):
        return [(DIGESTS, {"unreadable": True})]
    if not isinstance(digests, dict):
        return [(DIGESTS, {"unreadable": True})]
    names = set(_listed_files(folder)) | set(digests)
    return [(name, digests.get(name)) for name in sorted(names)]


# what a resume reads of a checkpoint folder: DeepSpeed's and the moving average's states by pattern (``*.pt``),
# the RNG states by name; a file of another name is never read, so one saved beside them is no damage
_READ = re.compile(r"(.*\.pt|rng_rank\d+\.safetensors)")


_FILE_NAME = re.compile(r"[\w.-]{1,200}(/[\w.-]{1,200}){0,4}")   # what DeepSpeed and PipeTrain name checkpoint files


def _may_be_read(name: str) -> bool:
    return _READ.fullmatch(Path(name).name) is not None


def _check(folder: Path, expected: list[tuple[str, dict | None]]) -> list[str]:
    problems = []
    for name, want in expected:
        path = folder / name
        if name == DIGESTS and want == {"unreadable": True}:
            problems.append(f"{path} cannot be read as a list of digests")
        elif want is None and _may_be_read(name):
            problems.append(f"{path} is not among the files the checkpoint was saved with")
        elif want is None:   # no resume reads it (e.g. an image ComfyUI's SaveImage wrote into the run folder)
            continue
        elif not isinstance(want, dict) or not _FILE_NAME.fullmatch(name) or ".." in Path(name).parts:
            # a name from digests.json: quoted only when it is a name a checkpoint's file could have
            problems.append(f"{folder / DIGESTS} lists an entry that is not a file of the checkpoint")
        elif not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != want.get("bytes"):
            problems.append(f"{path} has {path.stat().st_size} bytes, {want.get('bytes')} when saved (cut short "
                            "or changed)")
        elif _digest(path)["sha256"] != want.get("sha256"):
            problems.append(f"{path} differs from the file saved (its SHA-256 does not match)")
    return problems


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


def load(engine, ckpt_root: Path, tag: str, optimizer: bool = True, settings: bool = True) -> dict:
    """Load checkpoint ``tag`` into ``engine``; its client state. ``optimizer``: the optimizer's state (moments);
    ``settings``: its parameter groups' settings (lr, betas, weight decay) and the learning-rate schedule's state,
    else the config's and a schedule from its start (diffusion-pipe's --reset_optimizer / --reset_optimizer_params)."""
    load_checkpoints_weights_only(engine)
    groups = [{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.param_groups]
    with RegroupedLoads(engine, tag):
        _, client_state = engine.load_checkpoint(str(ckpt_root), tag=tag, load_module_strict=False,
                                                 load_optimizer_states=optimizer, load_lr_scheduler_states=settings)
    if not settings:
        for group, configured in zip(engine.optimizer.param_groups, groups):
            group.update(configured)
    rng, legacy = rng_file(ckpt_root / tag, dist.get_rank()), ckpt_root / tag / f"rng_rank{dist.get_rank():05d}.pt"
    state = load_file(str(rng)) if rng.is_file() else load_weights_only(legacy) if legacy.is_file() else None
    if state is not None:
        torch.set_rng_state(state["torch"])
        if state.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
    return client_state or {}


# --- checkpoints of one parameter group ----------------------------------------------------------------------------
# A full fine-tune's optimizer has two parameter groups since its one-dimensional parameters train without weight
# decay (``optim.decay_groups``, diffusion-pipe's); a checkpoint written before that has one group holding every
# trainable parameter of the stage, in the module's order. Its state (the moments) is each parameter's, so it is
# put into the groups by parameter; the settings are the old group's, but the one-dimensional group keeps its
# weight decay of 0. Any other difference in groups fails naming the checkpoint and the way out.


class RegroupedLoads:
    """While ``engine.load_checkpoint`` runs: the optimizer and schedule take a one-group state into their groups
    (above); a state of another layout fails as a ``CheckpointError`` saying what to do."""

    def __init__(self, engine, tag: str):
        self.engine, self.tag = engine, tag

    def __enter__(self):
        optimizer, scheduler = self.engine.optimizer, self.engine.lr_scheduler
        self.patched = []
        if optimizer is not None and hasattr(optimizer, "param_groups"):
            self._patch(optimizer, self._optimizer_state)
        if scheduler is not None and hasattr(scheduler, "base_lrs"):
            self._patch(scheduler, self._schedule_state)
        return self

    def __exit__(self, *exc):
        for obj in self.patched:
            del obj.load_state_dict   # the class's own again
        return False

    def _patch(self, obj, convert):
        original = obj.load_state_dict

        def load_state_dict(state, *args, **kwargs):
            return original(convert(state), *args, **kwargs)
        obj.load_state_dict = load_state_dict
        self.patched.append(obj)

    def _optimizer_state(self, state: dict) -> dict:
        groups = self.engine.optimizer.param_groups
        saved = state.get("param_groups", [])
        if len(saved) == len(groups):
            return state
        params = [p for p in self.engine.module.parameters() if p.requires_grad]   # the order a one-group one held
        if len(saved) != 1 or len(saved[0]["params"]) != len(params):
            raise CheckpointError(f"checkpoint {self.tag}: its optimizer state has {len(saved)} parameter group(s) "
                                  f"of {sum(len(g['params']) for g in saved)} parameters, this stage trains "
                                  f"{len(params)} in {len(groups)}: resume with --reset_optimizer (the weights "
                                  "and the data position load, the optimizer starts afresh)")
        index = {id(p): i for i, p in enumerate(q for group in groups for q in group["params"])}
        position = {saved_id: i for i, saved_id in enumerate(saved[0]["params"])}
        settings = {k: v for k, v in saved[0].items() if k != "params"}
        log.warning("checkpoint %s holds one optimizer parameter group (written before one-dimensional parameters "
                    "trained without weight decay): its state is loaded into this run's %d groups", self.tag,
                    len(groups))
        regrouped = []
        for k, group in enumerate(groups):   # the first: the decayed matrices; the rest keep their own decay (0)
            regrouped.append({**settings, **({"weight_decay": group["weight_decay"]} if k else {}),
                              "params": [index[id(p)] for p in group["params"]]})
        return {"state": {index[id(params[position[i]])]: value for i, value in state.get("state", {}).items()},
                "param_groups": regrouped}

    def _schedule_state(self, state: dict) -> dict:
        count = len(self.engine.optimizer.param_groups)
        base = state.get("base_lrs")
        if not isinstance(base, list) or len(base) == count or len(base) != 1:
            return state
        last = state.get("_last_lr") or base
        return {**state, "base_lrs": base * count, "_last_lr": list(last) * count}
