# SPDX-License-Identifier: GPL-3.0-or-later
"""Epoch samples rendered by the ComfyUI that started the run (``[samples] render = "host"``).

A run asks with a request file and a ``sample_request`` event (``backend/sampling/host_render.py``). The relay hands
each tick's new events to ``SampleHost``, which queues one prompt per request on ComfyUI's own queue: a graph
of the "PipeTrain Epoch Samples" node (``SAMPLES_NODE``), which renders with ``backend.sampling.render`` (the same
code as a headless run) inside ComfyUI, so ComfyUI's model management shares the GPU with other prompts.
Requests survive a restart: every ``rescan_s`` (and at the first tick) the runs' pending requests
(a request without a marker) are queued again, once per ComfyUI process.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from ..backend.sampling import host_render as sample_host
from ..backend.errors import PipeTrainError
from ..backend.run.folder import RunsRoot

log = logging.getLogger("pipetrain")
SAMPLES_NODE = "PipeTrainEpochSamples"


class SampleRequestError(PipeTrainError):
    pass


def request_file(dirs: RunsRoot, run_id: str, request: str) -> Path:
    """The request ``request`` (a LoRA stem) of run ``run_id``; only files inside the runs root."""
    if not sample_host.NAME.fullmatch(request or "") or ".." in request:
        raise SampleRequestError(f"invalid sample request name {request!r}")
    path = dirs.run(run_id).sample_requests / f"{request}.json"
    if not path.is_file():
        raise SampleRequestError(f"run {run_id} has no sample request {request!r} ({path})")
    return path


def sampling_graph(run_id: str, request: str) -> dict:
    """The ``/prompt`` graph that renders one request."""
    return {"1": {"class_type": SAMPLES_NODE, "inputs": {"run_id": run_id, "request": request}}}


def fulfil_request(dirs: RunsRoot, run_id: str, request: str):
    """Render (or read back) a request's samples here; returns (sample paths, IMAGE tensor [B, H, W, 3], AUDIO or
    None). An audio model's songs are the AUDIO ({"waveform": [B, channels, samples], "sample_rate"}), and the IMAGE
    one black 8x8 picture (the node's IMAGE output holds a tensor)."""
    from ..backend.sampling.audio import is_audio_file
    from ..backend.sampling.render import fulfil

    paths = fulfil(request_file(dirs, run_id, request), renderer="comfyui")
    songs = [p for p in paths if is_audio_file(p)]
    return paths, load_images([p for p in paths if not is_audio_file(p)]), load_songs(songs) if songs else None


def load_images(pngs: list[Path]):
    import numpy as np
    import torch
    from PIL import Image

    if not pngs:
        return torch.zeros(1, 8, 8, 3)
    arrays = [np.asarray(Image.open(p).convert("RGB"), dtype=np.float32) / 255.0 for p in pngs]
    return torch.from_numpy(np.stack(arrays))


def load_songs(paths: list[Path]) -> dict:
    """Songs of one length (one [samples] seconds) as ComfyUI's AUDIO, read as LoadAudio reads them."""
    import torch

    from ..backend.sampling.audio import load

    songs = [load(p) for p in paths]
    return {"waveform": torch.stack([w for w, _ in songs]), "sample_rate": songs[0][1]}


class SampleHost:
    """Queues a prompt for each sample request of the runs under ``dirs``; ``queue(graph)`` returns the
    prompt id, or None when ComfyUI is not ready yet (the request is tried again next tick)."""

    def __init__(self, dirs: RunsRoot, queue: Callable[[dict], str | None], rescan_s: float = 30.0):
        self.dirs = dirs
        self.queue = queue
        self.rescan_s = rescan_s
        self.queued: dict[str, str] = {}      # request file -> prompt id (in this ComfyUI process)
        self.waiting: set[tuple[str, str]] = set()   # (run id, request name) not queued yet
        self.next_scan = 0.0

    def tick(self, new_events: dict[str, list[dict]]) -> list[str]:
        """Queue what the runs asked for; returns the prompt ids queued now."""
        for run_id, events in new_events.items():
            for e in events:
                if e.get("type") == "sample_request" and isinstance(e.get("request"), str):
                    self.waiting.add((run_id, Path(e["request"]).stem))
        if time.monotonic() >= self.next_scan:
            self.next_scan = time.monotonic() + self.rescan_s
            for run_id in self.dirs.ids():
                self.waiting.update((run_id, p.stem) for p in sample_host.pending(self.dirs.run(run_id)))
        return [pid for item in sorted(self.waiting) if (pid := self._queue(*item))]

    def _queue(self, run_id: str, request: str) -> str | None:
        try:
            path = str(request_file(self.dirs, run_id, request))
        except (PipeTrainError, OSError):   # withdrawn meanwhile (answered, or the run rendered them)
            self.waiting.discard((run_id, request))
            return None
        if path in self.queued:
            self.waiting.discard((run_id, request))
            return None
        try:
            prompt_id = self.queue(sampling_graph(run_id, request))
        except Exception:  # noqa: BLE001  (once per process: the run falls back to rendering itself)
            log.exception("pipetrain: could not queue the epoch samples %s of run %s", request, run_id)
            prompt_id = ""
        if prompt_id is None:
            return None
        self.waiting.discard((run_id, request))
        self.queued[path] = prompt_id
        if prompt_id:
            log.info("pipetrain: queued the epoch samples %s of run %s (prompt %s)", request, run_id, prompt_id)
        return prompt_id or None
