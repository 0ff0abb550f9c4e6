# SPDX-License-Identifier: GPL-3.0-or-later
"""Requests to a live run from outside it (the panel, the ``/pipetrain`` routes): save now, sample now, stop after
this epoch, a new learning rate from the next step.

Like the ``stop`` file, a request is a file in the run folder: ``<run dir>/control/<action>.json``, written
atomically by whoever asks. Global rank 0 takes the requests there once a step (one directory listing; a rename
claims each file, so a request written while rank 0 reads is never lost, only taken at the next step) and
``train/control.py`` carries them to every rank. A second request of the same action before rank 0 takes the
first replaces it (the newest learning rate wins). No torch here: the launcher writes these files too.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..fsutil import atomic_write_json
from .folder import RunDir, read_json

SAVE, SAMPLE, STOP_AFTER_EPOCH, LR = "save", "sample", "stop_after_epoch", "lr"
ACTIONS = (SAVE, SAMPLE, STOP_AFTER_EPOCH, LR)
# far above any LoRA or fine-tune learning rate (Prodigy's 1.0 included), low enough that a typo (1e4 for 1e-4)
# is refused rather than wrecking the weights at the next step
MAX_LR = 10.0
_TAKEN = ".taken-"


class ControlValueError(ValueError):
    """A request that can never be valid (an unknown action, a learning rate that is no learning rate)."""


def check_lr(value) -> float:
    """``value`` as a learning rate: a finite number in (0, ``MAX_LR``]; a numeric string is accepted (query
    strings are strings)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ControlValueError(f"learning rate {value!r}: send a number, e.g. {{\"lr\": 1e-4}}")
    try:
        lr = float(value)
    except (ValueError, OverflowError):
        raise ControlValueError(f"learning rate {value!r} is not a number: send e.g. {{\"lr\": 1e-4}}") from None
    if not math.isfinite(lr) or not 0 < lr <= MAX_LR:
        raise ControlValueError(f"learning rate {value!r}: must be a finite number above 0 and at most {MAX_LR}")
    return lr


def check_action(action) -> str:
    if action not in ACTIONS:
        raise ControlValueError(f"unknown run control {action!r}: one of {', '.join(ACTIONS)}")
    return action


def request(run_dir: Path | RunDir, action: str, lr: float | None = None) -> dict:
    """Ask the run in ``run_dir`` for ``action`` (``lr``: the new learning rate); returns the request written."""
    check_action(action)
    body = {"action": action, "time": time.time()}
    if action == LR:
        body["lr"] = check_lr(lr)
    folder = RunDir(run_dir).control
    folder.mkdir(exist_ok=True)
    atomic_write_json(folder / f"{action}.json", body, durable=False)
    return body


def clear(run_dir: Path | RunDir) -> None:
    """Forget requests a run never took (it stopped first): a resumed run starts without them."""
    folder = RunDir(run_dir).control
    for action in ACTIONS:
        (folder / f"{action}.json").unlink(missing_ok=True)


@dataclass(frozen=True)
class Requests:
    """What the run is asked to do now (rank 0's view, then every rank's through ``train/control.py``)."""
    save: bool = False
    sample: bool = False
    stop_after_epoch: bool = False
    lr: float | None = None

    def __bool__(self) -> bool:
        return self.save or self.sample or self.stop_after_epoch or self.lr is not None


def take(run_dir: Path | RunDir) -> tuple[Requests, list[str]]:
    """Claim the pending requests (global rank 0, once a step); returns them and the problems of any request that
    could not be read (a hand-written file), which are dropped."""
    folder = RunDir(run_dir).control
    try:
        names = set(os.listdir(folder))
    except FileNotFoundError:
        return Requests(), []
    found, problems = {}, []
    for action in ACTIONS:
        if f"{action}.json" not in names:
            continue
        taken = folder / f"{_TAKEN}{action}.json"
        try:
            os.replace(folder / f"{action}.json", taken)
        except FileNotFoundError:
            continue
        body = read_json(taken)
        taken.unlink(missing_ok=True)
        if action == LR:
            try:
                found[LR] = check_lr(body.get("lr"))
            except ControlValueError as e:
                problems.append(f"control request {action}.json ignored: {e}")
        else:
            found[action] = True
    return Requests(**found), problems


def record_lr(run_dir: Path | RunDir, lr: float, from_step: int) -> None:
    """The learning rate the run trains with from ``from_step`` on, written durably before the change is announced:
    a run killed before its next checkpoint resumes with it (``applied_lr``)."""
    atomic_write_json(RunDir(run_dir).controls_file, {"lr": check_lr(lr), "from_step": int(from_step)})


def applied_lr(run_dir: Path | RunDir) -> tuple[float, int] | None:
    """(learning rate, from step) of the run's last acknowledged change, None if none; a file that is not one
    raises ``ControlValueError`` naming it."""
    path = RunDir(run_dir).controls_file
    if not path.exists():
        return None
    body = read_json(path)
    step = body.get("from_step") if isinstance(body, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ControlValueError(f"{path}: not a learning rate change this run made (no whole from_step); move it "
                                "away to resume with the learning rate of the checkpoint")
    try:
        return check_lr(body.get("lr")), step
    except ControlValueError as e:
        raise ControlValueError(f"{path}: {e}; move it away to resume with the learning rate of the "
                                "checkpoint") from None
