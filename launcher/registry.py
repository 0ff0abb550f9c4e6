# SPDX-License-Identifier: GPL-3.0-or-later
"""Runs as folders: ``<root>/<run_id>/`` with ``run.toml``, ``status.json``, ``events.jsonl``,
``launcher.json``, ``log.txt``, ``checkpoints/``. Reading a run never needs its process alive.

Run ids are validated by a strict pattern and the resolved folder must lie directly inside the root,
so nothing outside the run directories is ever read or written.
"""
from __future__ import annotations

import json
import re
import secrets
import threading
from datetime import datetime
from pathlib import Path

from ..backend.fsutil import atomic_write_json

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,79}$")
RESERVED = {"cache"}                       # the backend's shared cache folder under the runs root
ACTIVE = {"launched", "starting", "caching", "loading", "training"}
LOSS_POINTS = 2000


class RunIdError(ValueError):
    pass


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID.match(run_id) or run_id in RESERVED:
        raise RunIdError(f"invalid run id {run_id!r}: use letters, digits, '-' and '_' only (at most 80)")
    return run_id


def new_run_id(prefix: str = "") -> str:
    prefix = re.sub(r"[^A-Za-z0-9_-]+", "-", prefix).strip("-_")[:40]
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return check_run_id(f"{prefix + '-' if prefix else ''}{stamp}-{secrets.token_hex(2)}")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def read_events(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """Complete JSON lines from ``offset``; returns (events, offset after the last complete line)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    events = []
    for line in data[:end].splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events, offset + end


class RunDirs:
    """The runs root and the rules for finding a run's folder in it."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()

    def path(self, run_id: str) -> Path:
        check_run_id(run_id)
        p = (self.root / run_id).resolve()
        if p.parent != self.root:
            raise RunIdError(f"invalid run id {run_id!r}")
        return p

    def exists(self, run_id: str) -> bool:
        try:
            p = self.path(run_id)
        except RunIdError:
            return False
        return p.is_dir() and any((p / n).exists() for n in ("launcher.json", "status.json", "run.toml"))

    def ids(self) -> list[str]:
        """Run ids, newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and RUN_ID.match(p.name)
                 and p.name not in RESERVED and self.exists(p.name)]
        return [p.name for p in sorted(found, key=_started, reverse=True)]


def _started(p: Path) -> float:
    info = read_json(p / "launcher.json")
    return float(info.get("created") or read_json(p / "status.json").get("started") or p.stat().st_mtime)


def write_launcher_info(run_dir: Path, info: dict) -> None:
    atomic_write_json(run_dir / "launcher.json", info)


def run_state(status: dict, info: dict, alive: bool) -> str:
    """The one state the UI shows, from the backend's status, the launcher's record and the process."""
    state = status.get("state") or ("launched" if info else "unknown")
    if info.get("killed") and not alive:
        return "killed"
    if alive:  # "stopped" only once the processes are gone: the backend reports it just before exiting
        return "stopping" if state == "stopped" or (info.get("stop_requested") and state in ACTIVE) else state
    if state in ACTIVE:
        return "stopped" if info.get("stop_requested") else "failed"
    return state


def summarize(run_dirs: RunDirs, run_id: str, alive: bool) -> dict:
    d = run_dirs.path(run_id)
    status, info = read_json(d / "status.json"), read_json(d / "launcher.json")
    state = run_state(status, info, alive)
    error = status.get("error")
    if state == "failed" and not error:
        error = f"the training process exited without reporting; see {d / 'log.txt'}"
    keys = ("step", "total_steps", "epoch", "epochs", "loss", "lr", "samples_per_s", "eta_s", "last_checkpoint",
            "updated", "cache")
    return {"id": run_id, "state": state, "alive": alive, "error": error,
            "loras": saved_loras(d, status), "gpus": info.get("gpus", []),
            "created": info.get("created"), "name": info.get("name", run_id),
            "resumable": bool(_latest_checkpoint(d)) and not alive,
            # several machines: {launcher, hosts, ...}; for no_ssh the commands the other nodes run
            "cluster": info.get("cluster"), "node_commands": info.get("node_commands", []),
            **{k: status.get(k) for k in keys}}


_lora_scans: dict[Path, tuple[int, dict[str, dict]]] = {}   # events.jsonl -> (offset, LoRAs by path)
_lora_lock = threading.Lock()


def saved_loras(run_dir: Path, status: dict | None = None) -> list[dict]:
    """Every epoch LoRA of the run (a full fine-tune: every epoch model) as {epoch, step, path, samples, kind},
    oldest first: ``status.json``'s lists and the ``lora_saved`` / ``model_saved`` events, which also hold the LoRAs saved before a resume (the backend starts a resumed
    run's status afresh). The events file is read incrementally, so polling a long run stays cheap."""
    status = read_json(run_dir / "status.json") if status is None else status
    path = run_dir / "events.jsonl"
    with _lora_lock:
        offset, found = _lora_scans.get(path, (0, {}))
        try:
            if path.stat().st_size < offset:          # rewritten: read it again
                offset, found = 0, {}
        except OSError:
            offset, found = 0, {}
        events, offset = read_events(path, offset)
        found = dict(found)
        for e in events:
            if e.get("type") in ("lora_saved", "model_saved") and e.get("path") and not e.get("at_step"):
                found[e["path"]] = {"epoch": e.get("epoch"), "step": e.get("step"), "path": e["path"], "samples": [],
                                    "kind": "model" if e["type"] == "model_saved" else "lora"}
            elif e.get("type") == "sample_saved" and isinstance(e.get("path"), str):
                lora = _lora_of_sample(e["path"])
                if lora in found:
                    sample = {"name": Path(e["path"]).name, "path": e["path"], "prompt": e.get("prompt")}
                    found[lora] = {**found[lora], "samples": [
                        *(x for x in found[lora]["samples"] if x["path"] != e["path"]), sample]}
        _lora_scans[path] = (offset, found)
    merged = dict(found)
    for kind, key in (("lora", "loras"), ("model", "models")):
        for x in status.get(key, []):
            if isinstance(x, dict) and x.get("path"):
                samples = merged.get(x["path"], {}).get("samples", [])
                merged[x["path"]] = {"epoch": x.get("epoch"), "step": x.get("step"), "path": x["path"],
                                     "samples": samples, "kind": kind}
    return sorted(merged.values(), key=lambda x: (x.get("epoch") or 0, x.get("step") or 0))


def _lora_of_sample(png: str) -> str:
    """``<stem>-sample00.png`` (``backend.sampling.sample_paths``) -> ``<stem>.safetensors``."""
    stem, _, _ = png.rpartition("-sample")
    return f"{stem}.safetensors"


def sample_file(run_dirs: RunDirs, run_id: str, name: str) -> Path:
    """An announced sample image of the run, by file name (KeyError for anything else)."""
    for lora in saved_loras(run_dirs.path(run_id)):
        for sample in lora.get("samples", []):
            if sample["name"] == name and Path(sample["path"]).is_file():
                return Path(sample["path"])
    raise KeyError(name)


def _latest_checkpoint(run_dir: Path) -> str | None:
    try:
        tag = (run_dir / "checkpoints" / "latest").read_text().strip()
    except OSError:
        return None
    return tag if tag and (run_dir / "checkpoints" / tag).is_dir() else None


def details(run_dirs: RunDirs, run_id: str, alive: bool) -> dict:
    """The summary plus the loss curve and the last events (for the panel)."""
    d = run_dirs.path(run_id)
    events, _ = read_events(d / "events.jsonl")
    losses = [[e.get("step"), e.get("loss")] for e in events if e.get("type") == "step" and e.get("loss") is not None]
    if len(losses) > LOSS_POINTS:
        stride = -(-len(losses) // LOSS_POINTS)
        losses = losses[::stride] + ([losses[-1]] if (len(losses) - 1) % stride else [])
    out = summarize(run_dirs, run_id, alive)
    out.update(losses=losses, events=events[-50:], run_dir=str(d))
    return out


def lora_for_epoch(run_dirs: RunDirs, run_id: str, epoch: int = 0) -> dict | None:
    """The saved LoRA of ``epoch`` (0: the newest) as {epoch, step, path}, or None."""
    loras = [x for x in saved_loras(run_dirs.path(run_id)) if Path(x["path"]).is_file() and x.get("kind") != "model"]
    if epoch > 0:
        loras = [x for x in loras if x.get("epoch") == epoch]
    return max(loras, key=lambda x: (x.get("epoch", 0), x.get("step", 0)), default=None)


__all__ = ["ACTIVE", "RunDirs", "RunIdError", "check_run_id", "details", "lora_for_epoch",
           "new_run_id", "read_events", "read_json", "run_state", "sample_file", "saved_loras", "summarize",
           "write_launcher_info"]
