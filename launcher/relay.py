# SPDX-License-Identifier: GPL-3.0-or-later
"""A daemon thread that tails every run's ``events.jsonl`` and sends new events to the browser.

Each tick, per run with something new: one ``pipetrain.event`` message
``{"run_id", "events": [...new events...], "run": <summary>}``. A run's summary is also sent when its
state changes without an event (its process died, a stop was requested). Each tick's new events also go to
the ``SampleHost`` (``samples.py``), which queues the epoch samples runs ask ComfyUI for.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from .core import Launcher
from .summaries import summarize
from .samples import SampleHost

log = logging.getLogger("pipetrain")
EVENT = "pipetrain.event"


class EventRelay:
    def __init__(self, launcher: Launcher, send: Callable[[str, dict], None], interval: float = 0.5,
                 sample_host: SampleHost | None = None):
        self.launcher = launcher
        self.send = send
        self.sample_host = sample_host
        self.interval = interval
        self.offsets: dict[str, int] = {}
        self.states: dict[str, tuple] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for run_id in launcher.dirs.ids():        # history is served by the routes, not replayed
            self.offsets[run_id] = _size(launcher.dirs.run(run_id).events_file)

    def start(self) -> "EventRelay":
        self._thread = threading.Thread(target=self._run, name="pipetrain-relay", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception:  # noqa: BLE001  (the relay must outlive a bad file)
                log.exception("pipetrain: event relay tick failed")

    def tick(self) -> int:
        """One pass over the runs; returns the number of messages sent."""
        self.launcher.poll()
        sent = 0
        new_events = {}
        for run_id in self.launcher.dirs.ids():
            events, self.offsets[run_id] = self.launcher.dirs.run(run_id).read_events(self.offsets.get(run_id, 0))
            new_events[run_id] = events
            summary = summarize(self.launcher.dirs, run_id, self.launcher.alive(run_id))
            key = (summary["state"], summary["alive"], summary["step"], len(summary["loras"]))
            if events or key != self.states.get(run_id):
                self.states[run_id] = key
                self.send(EVENT, {"run_id": run_id, "events": events, "run": summary})
                sent += 1
        if self.sample_host is not None:
            try:
                self.sample_host.tick(new_events)
            except Exception:  # noqa: BLE001
                log.exception("pipetrain: queueing epoch samples failed")
        return sent


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
