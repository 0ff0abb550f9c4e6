"""What a run reports, through files only: ``events.jsonl`` (one JSON object a line), ``status.json``
(the latest state, rewritten atomically) and TensorBoard scalars. Written by global rank 0."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..fsutil import atomic_write_json


class RunReporter:
    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir = run_dir
        self.enabled = enabled
        self.status: dict = {"state": "starting", "pid": os.getpid(), "started": time.time()}
        self._tb = None

    def event(self, type_: str, **fields) -> None:
        if not self.enabled:
            return
        record = {"type": type_, "time": time.time(), **fields}
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def update(self, **fields) -> None:
        if not self.enabled:
            return
        self.status.update(fields, updated=time.time())
        atomic_write_json(self.run_dir / "status.json", self.status)

    def scalars(self, step: int, **values) -> None:
        if not self.enabled:
            return
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional at run time
                self._tb = False
                return
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if self._tb:
            for name, value in values.items():
                self._tb.add_scalar(name, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb:
            self._tb.close()
