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
            break
        if cancelled():
            ref.signal_group(signal.SIGTERM)
            ref.popen.wait(10)
            raise CacheError("caching cancelled")
        time.sleep(poll)
    code = ref.popen.wait()
    if code != 0 or not result:
        raise failure(log, code)
    return result


ERROR_LINE = "pipetrain: error: "   # how ``backend/cli.py`` reports a refusal


def failure(log: Path, code: int | None) -> CacheError:
    """The Cache node's error: the child's refusal, its first line only (what follows lists the dataset's files,
    and the message goes to whoever queued the prompt), else the log's last line; the whole log is named."""
    lines = log.read_text(errors="replace").strip().splitlines()
    refusal = [line[len(ERROR_LINE):] for line in lines if line.startswith(ERROR_LINE)]
    reason = refusal[-1] if refusal else (lines[-1] if lines else "no output")
    return CacheError(f"caching failed (exit code {code}): {reason.rstrip(':')}; the whole log: {log}")
