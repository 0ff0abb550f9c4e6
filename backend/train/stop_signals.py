# SPDX-License-Identifier: GPL-3.0-or-later
"""SIGINT (Ctrl-C) and SIGTERM ask the run to checkpoint at the next step boundary and stop; a second one stops this
rank at once.

One request often arrives as several signals: Ctrl-C reaches every process of the terminal's group, DeepSpeed's
``launch.py``, interrupted too, terminates its ranks, and ``python -m pipetrain deepspeed`` passes its own on. Those
that come within ``REPEAT_S`` of the first are that same request; a later one is the user's second.

A thread learns of each signal as it arrives (``signal.set_wakeup_fd``), not when the main thread next runs Python
code (it may be inside a step's kernels or a collective for long): a second signal ends the rank even there, and
the launcher watch knows of a stop asked for as the launcher went."""
from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_S = 2.0


class StopSignals:
    def __init__(self, at_once: Callable[[int], None], first: Callable[[int], None] | None = None):
        """``at_once(signum)``: called from the thread on a second signal; expected not to return. ``first``: called
        from the thread on the first one (caching alone ends there; a run stops at its next step instead)."""
        self.signum: int | None = None   # the first signal's number, once one came
        self._first_at = 0.0
        self._at_once = at_once
        self._first = first
        self._sockets = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        """From the main thread (Python's rule for signal handlers)."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for sig in SIGNALS:   # the thread acts; this handler keeps the default one (exit, KeyboardInterrupt) away
            signal.signal(sig, self._handler)
        self._sockets = (reader, writer)   # kept open as long as this object lives
        threading.Thread(target=self._read, args=(reader,), name="pipetrain-stop-signals", daemon=True).start()

    def _handler(self, signum, frame) -> None:
        # the first signal also counts from here, should a library have taken the wakeup file meanwhile; never a
        # second one: the main thread runs this late, after a long step, when the thread has counted it already
        if self.signum is None:
            self.received(signum)

    def _read(self, reader: socket.socket) -> None:
        while data := reader.recv(64):
            for signum in data:
                self.received(signum)

    def received(self, signum: int) -> None:
        if signum not in SIGNALS:
            return
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            if self._first is not None:
                self._first(signum)
        elif now - self._first_at > REPEAT_S:
            self._at_once(signum)
        elif signum == signal.SIGINT:
            # Ctrl-C's SIGINT and the SIGTERM DeepSpeed's launch.py sends on for it are handled by two threads at
            # once and may reach the wakeup file in either order: the request is the Ctrl-C
            self.signum = signum


def describe(signum: int) -> str:
    return signal.Signals(signum).name + (" (Ctrl-C)" if signum == signal.SIGINT else "")
