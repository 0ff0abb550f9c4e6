# SPDX-License-Identifier: GPL-3.0-or-later
"""What the UI shows of a run, read from its folder alone (``backend/run/folder.py`` names the files): its one
state, the saved LoRAs and their samples, the loss curve and the last events. Reading a run never needs its
process alive.
"""
from __future__ import annotations

import re
import stat
import threading
from pathlib import Path

from ..backend.run.folder import RunDir, RunsRoot, read_events

ACTIVE = {"launched", "starting", "caching", "loading", "training"}
LOSS_POINTS = 2000


def run_state(status: dict, info: dict, alive: bool, stale: bool = False) -> str:
    """The one state the UI shows, from the backend's status, the launcher's record and the process. ``stale``:
    ``status.json`` is the one the previous launch left (the new process has not reported yet)."""
    state = status.get("state") or ("launched" if info else "unknown")
    if info.get("killed") and not alive:
        return "killed"
    if alive:  # "stopped" only once the processes are gone: the backend reports it just before exiting
        if info.get("stop_requested"):         # launch() writes a record without it: asked during this launch
            return "stopping" if state == "stopped" or state in ACTIVE or stale else state
        if stale and state not in ACTIVE:       # the previous launch's last word ("stopped", "failed")
            return "resuming" if info.get("launches", 1) > 1 else "launched"
        return "stopping" if state == "stopped" else state
    if stale and state not in ACTIVE and info.get("launches", 1) > 1:
        return "failed"                         # the resumed process exited before it reported anything
    if state in ACTIVE:
        return "stopped" if info.get("stop_requested") else "failed"
    return state


def file_identity(path: Path) -> list[int] | None:
    """Changes whenever the file is rewritten (atomic writes give it a new inode); no clocks involved, so it holds
    when rank 0 runs on another machine."""
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_ino, st.st_mtime_ns]


def summarize(runs: RunsRoot, run_id: str, alive: bool) -> dict:
    d = runs.run(run_id)
    status, info = d.read_status(), d.read_launcher()
    stale = "status_before" in info and file_identity(d.status_file) == info["status_before"]
    state = run_state(status, info, alive, stale)
    error = None if stale else status.get("error")
    if state == "failed" and not error:
        error = f"the training process exited without reporting; see {d.log_file}"
    keys = ("step", "total_steps", "epoch", "epochs", "loss", "lr", "samples_per_s", "eta_s", "last_checkpoint",
            "updated", "cache", "comfyui", "memory",   # comfyui: the ComfyUI that trains and its parity verdict;
            "base_lr", "stop_after_epoch",   # memory: what memory = "auto" chose; these two: run control
            "warnings")   # what the run says is wrong while it goes on ({key: message})
    return {"id": run_id, "state": state, "alive": alive, "error": error,
            "loras": saved_loras(d, status), "step_samples": sampled_step_loras(d), "gpus": info.get("gpus", []),
            "cpu": bool(info.get("cpu")),   # ranks on the CPU: the machine had no GPU when it started
            "created": info.get("created"), "name": info.get("name", run_id),
            # a finished run has nothing left to train: resuming it would only write its last epoch again
            # (by the backend's word: a Kill in its last moments must not make it resumable)
            "resumable": bool(d.latest_checkpoint()) and not alive and status.get("state") != "finished",
            # several machines: {launcher, hosts, ...}; for no_ssh the commands the other nodes run
            "cluster": info.get("cluster"), "node_commands": info.get("node_commands", []),
            **{k: status.get(k) for k in keys}}


_lora_scans: dict[Path, tuple[int, dict[str, dict]]] = {}   # events.jsonl -> (offset, LoRAs by path)
_lora_lock = threading.Lock()


def _scan(run_dir: RunDir) -> dict[str, dict]:
    """The LoRAs the events announce, by path, with their samples: epoch LoRAs (and models) and step LoRAs
    (``kind`` "step"). The events file is read incrementally, so polling a long run stays cheap."""
    path = run_dir.events_file
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
            kind = {"lora_saved": "lora", "model_saved": "model", "step_lora_saved": "step"}.get(e.get("type"))
            if kind and e.get("at_step"):     # a full fine-tune's step model
                kind = "step"
            if kind and e.get("path"):
                found[e["path"]] = {"epoch": e.get("epoch"), "step": e.get("step"), "path": e["path"], "samples": [],
                                    "kind": kind}
            elif e.get("type") == "sample_saved" and isinstance(e.get("path"), str):
                lora = _lora_of_sample(e["path"])
                if lora in found:
                    sample = {"name": Path(e["path"]).name, "path": e["path"], "prompt": e.get("prompt"),
                              "prompt_index": e.get("prompt_index"), "strength": e.get("strength", 1.0)}
                    found[lora] = {**found[lora], "samples": [
                        *(x for x in found[lora]["samples"] if x["path"] != e["path"]), sample]}
        _lora_scans[path] = (offset, found)
    return found


def saved_loras(run_dir: Path | RunDir, status: dict | None = None) -> list[dict]:
    """Every epoch LoRA of the run (a full fine-tune: every epoch model) as {epoch, step, path, samples, kind},
    oldest first: ``status.json``'s lists and the ``lora_saved`` / ``model_saved`` events, which also hold the
    LoRAs saved before a resume (the backend starts a resumed run's status afresh)."""
    run_dir = RunDir(run_dir)
    status = run_dir.read_status() if status is None else status
    merged = {p: x for p, x in _scan(run_dir).items() if x["kind"] != "step"}
    for kind, key in (("lora", "loras"), ("model", "models")):
        for x in status.get(key, []):
            if isinstance(x, dict) and x.get("path"):
                samples = merged.get(x["path"], {}).get("samples", [])
                merged[x["path"]] = {"epoch": x.get("epoch"), "step": x.get("step"), "path": x["path"],
                                     "samples": samples, "kind": kind}
    return sorted(merged.values(), key=lambda x: (x.get("epoch") or 0, x.get("step") or 0))


def sampled_step_loras(run_dir: Path | RunDir) -> list[dict]:
    """The step LoRAs that have samples (a "sample now" request: ``backend/run/control.py``), oldest first."""
    return sorted((x for x in _scan(RunDir(run_dir)).values() if x["kind"] == "step" and x["samples"]),
                  key=lambda x: x.get("step") or 0)


def _lora_of_sample(png: str) -> str:
    """``<stem>-sample00.png`` (``backend.sampling.render.sample_paths``) -> ``<stem>.safetensors``."""
    stem, _, _ = png.rpartition("-sample")
    return f"{stem}.safetensors"


SAMPLE_NAME = re.compile(r"-sample\d{2,}(-x-?\d+(\.\d+)?)?\.(png|webp|flac)$")   # ``sampling.sample_paths``


def own_file(path: str | Path, run: RunDir, lora_root: Path | None) -> Path | None:
    """``path`` resolved (links followed) where it is a regular file in the run's folder or its LoRA folder
    (``lora_root/<run id>``), the places PipeTrain writes a run's files; else None. An ``events.jsonl`` line is
    only a line of a file: what it names (another run's files, /etc/passwd) is not served or loaded for it."""
    homes = [run.path.resolve()] + ([(Path(lora_root) / run.name).resolve()] if lora_root else [])
    try:
        real = Path(path).resolve(strict=True)
        regular = stat.S_ISREG(real.stat().st_mode)
    except (OSError, RuntimeError):    # missing, a link loop
        return None
    return real if regular and any(real.is_relative_to(home) for home in homes) else None


def sample_file(runs: RunsRoot, run_id: str, name: str, lora_root: Path | None = None) -> Path:
    """An announced sample of the run, by file name (KeyError for anything else): a file named as
    ``sampling.sample_paths`` names samples, and the run's own (``own_file``)."""
    run = runs.run(run_id)
    if not SAMPLE_NAME.search(name):
        raise KeyError(name)
    for lora in saved_loras(run) + sampled_step_loras(run):
        for sample in lora.get("samples", []):
            real = own_file(sample["path"], run, lora_root) if sample["name"] == name else None
            if real is not None and real.name == name:
                return real
    raise KeyError(name)


def details(runs: RunsRoot, run_id: str, alive: bool) -> dict:
    """The summary plus the loss curve and the last events (for the panel)."""
    d = runs.run(run_id)
    events, _ = d.read_events()
    losses = [[e.get("step"), e.get("loss")] for e in events if e.get("type") == "step" and e.get("loss") is not None]
    if len(losses) > LOSS_POINTS:
        stride = -(-len(losses) // LOSS_POINTS)
        losses = losses[::stride] + ([losses[-1]] if (len(losses) - 1) % stride else [])
    out = summarize(runs, run_id, alive)
    out.update(losses=losses, events=events[-50:], run_dir=str(d), best_epoch=best_epoch(events))
    return out


def best_epoch(events: list[dict]) -> dict | None:
    """The epoch whose held-out loss is lowest ({epoch, loss}), from the ``eval`` events that follow epoch
    LoRAs (several eval datasets: their mean); None without any."""
    saved = {e.get("epoch") for e in events if e.get("type") in ("lora_saved", "model_saved") and not e.get("at_step")}
    by_epoch: dict[int, dict[str, float]] = {}
    for e in events:
        if e.get("type") == "eval" and e.get("epoch") in saved and isinstance(e.get("loss"), (int, float)):
            by_epoch.setdefault(e["epoch"], {})[e.get("name", "eval")] = float(e["loss"])
    if not by_epoch:
        return None
    means = {epoch: sum(v.values()) / len(v) for epoch, v in by_epoch.items()}
    epoch = min(means, key=lambda k: (means[k], k))
    return {"epoch": epoch, "loss": means[epoch]}


def lora_for_epoch(runs: RunsRoot, run_id: str, epoch: int = 0, lora_root: Path | None = None) -> dict | None:
    """The saved LoRA of ``epoch`` (0: the newest) as {epoch, step, path}, or None; only the run's own files
    (``own_file``) count."""
    run = runs.run(run_id)
    loras = [x for x in saved_loras(run) if x.get("kind") != "model" and own_file(x["path"], run, lora_root)]
    if epoch > 0:
        loras = [x for x in loras if x.get("epoch") == epoch]
    return max(loras, key=lambda x: (x.get("epoch", 0), x.get("step", 0)), default=None)


__all__ = ["ACTIVE", "best_epoch", "details", "file_identity", "lora_for_epoch", "run_state", "sample_file",
           "sampled_step_loras", "saved_loras", "summarize"]
