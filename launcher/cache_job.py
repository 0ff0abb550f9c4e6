# SPDX-License-Identifier: GPL-3.0-or-later
"""Caching alone, for the Cache node: ``python -m pipetrain cache run.toml`` as a child process.

The config goes to ``<runs root>/.cache-jobs/<hash of the specs>/`` (the same dataset gives the same
folder, so the backend reuses its manifest); progress comes from the events of ``<runs root>/cache/``
(``RunsRoot.cache``).
The cache is content-addressed, so a second call with nothing changed encodes nothing.
"""
from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from ..backend.errors import CacheError
from ..backend.run.folder import RunDir, RunsRoot
from .build import write_config
from .procs import child_env, python_argv, spawn
from .specs import TrainSpec

Progress = Callable[[str, int, int], None]


def job_dir(runs_root: Path, spec: TrainSpec) -> Path:
    key = json.dumps([spec.dataset.__repr__(), spec.model.__repr__()]).encode()
    return Path(runs_root) / ".cache-jobs" / hashlib.sha256(key).hexdigest()[:16]


def run_cache(spec: TrainSpec, runs_root: Path, *, comfyui_root: Path | None, progress: Progress,
              cancelled: Callable[[], bool] = lambda: False, poll: float = 0.2) -> dict:
    """Encode what is missing; returns the backend's ``cached`` event. ``CacheError`` on failure."""
    runs_root = Path(runs_root)
    folder = job_dir(runs_root, spec)
    run_toml = write_config(spec, folder, output_dir=runs_root, run_name=None, lora_dir=None)
    cache = RunsRoot(runs_root).cache
    offset = cache.events_file.stat().st_size if cache.events_file.exists() else 0
    log = RunDir(folder).log_file
    log.write_bytes(b"")
    env = child_env(comfyui_root)
    ref = spawn(python_argv("cache", str(run_toml)), cwd=folder, log_path=log, env=env)
    try:
        result = follow(ref, cache, offset, progress, cancelled, poll)
    except BaseException:
        # Cancel, or ComfyUI's progress hook raising its interrupt, or anything else: the child goes too
        stop(ref)
        raise
    code = ref.popen.wait()
    if code != 0 or not result:
        raise failure(log, code)
    return result


def follow(ref, cache: RunDir, offset: int, progress: Progress, cancelled: Callable[[], bool], poll: float) -> dict:
    """Relay the child's progress until it exits; its ``cached`` event (empty if none came)."""
    result: dict = {}
    while True:
        done = not ref.leader_alive()
        events, offset = cache.read_events(offset)
        for e in events:
            if e.get("type") == "cache":
                progress(str(e.get("kind", "")), int(e.get("done", 0)), int(e.get("total", 0)))
            elif e.get("type") == "cached":
                result = e
        if done:
            return result
        if cancelled():
            raise CacheError("caching cancelled; what was cached so far is kept")
        time.sleep(poll)


STOP_GRACE_S = 15.0   # the child stops after the batch it encodes (a caching_batch_size of large images)


def stop(ref) -> None:
    """End the caching child: SIGTERM (it stops after the entry it stores, ``backend/train/caching.py``), then
    SIGKILL to its group past ``STOP_GRACE_S``; reaped either way, so no zombie stays behind ComfyUI."""
    if ref.popen.poll() is not None:
        return
    ref.signal_group(signal.SIGTERM)
    try:
        ref.popen.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        ref.signal_group(signal.SIGKILL)
        ref.popen.wait()


ERROR_LINE = "pipetrain: error: "   # how ``backend/cli.py`` reports a refusal


def failure(log: Path, code: int | None) -> CacheError:
    """The Cache node's error: the child's refusal, its first line only (what follows lists the dataset's files,
    and the message goes to whoever queued the prompt), else the log's last line; the whole log is named."""
    lines = log.read_text(errors="replace").strip().splitlines()
    refusal = [line[len(ERROR_LINE):] for line in lines if line.startswith(ERROR_LINE)]
    reason = refusal[-1] if refusal else (lines[-1] if lines else "no output")
    return CacheError(f"caching failed (exit code {code}): {reason.rstrip(':')}; the whole log: {log}")
