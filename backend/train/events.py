"""What a run reports, through files only (``rundir.RunDir`` names them): its events (one JSON object a
line), its status (the latest state, rewritten atomically) and TensorBoard scalars. Written by global rank 0."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from ..fsutil import OutOfSpace, atomic_write_json, rewrite_in_place, space_guard
from ..run.folder import RunDir, read_events, read_object

log = logging.getLogger("pipetrain")


def with_entry(entries: list[dict], entry: dict) -> list[dict]:
    """A status list of saved files with ``entry`` last, in place of an earlier entry of the same path (a file
    a resumed run wrote again)."""
    return [e for e in entries if e.get("path") != entry["path"]] + [entry]


class RunReporter:
    def __init__(self, run_dir: RunDir, enabled: bool, tensorboard: Path | None = None):
        """``tensorboard``: the folder of the event files (default the run's ``tensorboard/``; diffusion-pipe's run
        layout: the run folder itself, where its users' scripts read them)."""
        self.run_dir = RunDir(run_dir)
        self.enabled = enabled
        self._tensorboard = tensorboard or self.run_dir.tensorboard
        # warnings: what the run says is wrong while it goes on (a changed dataset, a rank that does not answer),
        # by a key that clears it; each launch starts with none
        self.status: dict = {"state": "starting", "pid": os.getpid(), "started": time.time(), "warnings": {}}
        self._lock = threading.RLock()   # the peer watch thread reports beside the main thread
        self._line_start = False   # whether events.jsonl is known to end with a whole line
        if enabled:  # a resumed run keeps what it reported before (its epoch LoRAs above all)
            previous = read_object(self.run_dir.status_file)
            unreadable = previous is None and self.run_dir.status_file.is_file()
            if unreadable:   # cut, binary or not an object: what it listed comes back from the events
                previous = self._saved_from_events()
            self.status = {**(previous or {}), **self.status, "error": None}
            if unreadable:
                message = (f"{self.run_dir.status_file} could not be read (cut or damaged): it is written anew, its "
                           "lists of saved LoRAs and models taken from the run's events")
                log.warning("%s", message)
                self.event("warning", message=message)
        self._tb = None
        self.wandb = None   # train/wandb_sink.py: the same scalars to Weights & Biases ([monitoring])

    def _saved_from_events(self) -> dict:
        saved: dict[str, list] = {}
        for e in read_events(self.run_dir.events_file)[0]:
            key = {"lora_saved": "loras", "model_saved": "models"}.get(e.get("type"))
            if key and isinstance(e.get("path"), str):
                saved[key] = with_entry(saved.get(key, []), {k: e.get(k) for k in ("epoch", "step", "path")})
        return saved

    def event(self, type_: str, **fields) -> None:
        if not self.enabled:
            return
        record = {"type": type_, "time": time.time(), **fields}
        line = (json.dumps(record) + "\n").encode()
        with self._lock, space_guard(self.run_dir.path), open(self.run_dir.events_file, "ab+") as f:
            if not self._line_start:   # a run killed mid-write left a cut line: ours must not join it
                f.seek(0, os.SEEK_END)
                if f.tell() > 0:
                    f.seek(-1, os.SEEK_END)
                    line = (b"" if f.read(1) == b"\n" else b"\n") + line
                self._line_start = True
            f.write(line)   # one write of a whole line (append mode)

    def update(self, **fields) -> None:
        if not self.enabled:
            return
        with self._lock, space_guard(self.run_dir.path):
            self.status.update(fields, updated=time.time())
            atomic_write_json(self.run_dir.status_file, self.status, durable=False)   # rewritten every step

    def warn(self, key: str, message: str, **fields) -> None:
        """A ``warning`` event, and ``message`` in the status's warnings under ``key`` until ``clear_warning``."""
        if not self.enabled:
            return
        with self._lock:
            self.event("warning", message=message, **fields)
            self.update(warnings={**self.status.get("warnings", {}), key: message})

    def clear_warning(self, key: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            warnings = dict(self.status.get("warnings", {}))
            if warnings.pop(key, None) is not None:
                self.update(warnings=warnings)

    def fail(self, message: str, state: str = "failed", **fields) -> None:
        """The run's last word: an ``error`` event and the ``state`` (with ``message`` as its error) in the
        status, written even where the disk holding the run folder is full (then the event may be lost: the
        status, which the panel and the CLI read, is rewritten in the space it held)."""
        if not self.enabled:
            return
        try:
            self.event("error", message=message, **fields)
        except OutOfSpace:
            pass
        try:
            self.update(state=state, error=message, **fields)
        except OutOfSpace:
            data = json.dumps(self.status, indent=1, sort_keys=True).encode()
            try:
                rewrite_in_place(self.run_dir.status_file, data)
            except OSError:   # no status to rewrite, or no room even there: the run's own error still goes up
                pass

    def _writer(self):
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional at run time
                self._tb = False
                return False
            self._tb = SummaryWriter(log_dir=str(self._tensorboard))
        return self._tb

    def scalars(self, step: int, **values) -> None:
        if self.enabled and self.wandb is not None:
            self.wandb.log(step, values)
        if not self.enabled or not self._writer():
            return
        for name, value in values.items():
            self._tb.add_scalar(name, value, step)
        self._tb.flush()

    def epoch_scalar(self, epoch: int, step: int, name: str, value: float) -> None:
        """A scalar of a whole epoch: TensorBoard's x is the epoch (diffusion-pipe's ``train/epoch_loss``), W&B's
        the step (its steps only grow), with the epoch beside it."""
        if self.enabled and self.wandb is not None:
            self.wandb.log(step, {name: value, "epoch": epoch})
        if not self.enabled or not self._writer():
            return
        self._tb.add_scalar(name, value, epoch)
        self._tb.flush()

    def image(self, tag: str, png_path, step: int) -> None:
        if not self.enabled or not self._writer():
            return
        import numpy as np
        from PIL import Image

        self._tb.add_image(tag, np.asarray(Image.open(png_path).convert("RGB")), step, dataformats="HWC")
        self._tb.flush()

    def audio(self, tag: str, path, step: int) -> None:
        """An audio model's sample song (read as ComfyUI's LoadAudio reads it), its channels averaged."""
        if not self.enabled or not self._writer():
            return
        from ..sampling.audio import load

        waveform, rate = load(path)
        self._tb.add_audio(tag, waveform.float().mean(0, keepdim=True).clamp(-1, 1), step, sample_rate=rate)
        self._tb.flush()

    def close(self) -> None:
        if self._tb:
            self._tb.close()
        if self.wandb is not None:
            self.wandb.close()
