"""A rank that stops answering (SIGSTOP, a hung driver, a machine swapping) holds every other rank inside a collective
until the process group's timeout, minutes later, and nothing says so. Each rank's daemon thread counts a heartbeat
in the process group's key-value store (hosted by global rank 0's process) every few seconds; global rank 0 reads the
others' counts and says when one has not moved for ``silence_s()`` seconds (the log, a ``warning`` event and the
status's warnings), again each time the silence doubles, and once more when the rank answers again. The other ranks
say when the store itself, that is rank 0, stops answering. Threads run while the main thread waits in a collective,
so a rank that only waits for a frozen one keeps beating."""
from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta

log = logging.getLogger("pipetrain")

SILENCE_ENV = "PIPETRAIN_PEER_SILENCE_S"   # operators and tests: seconds without a heartbeat before a rank is named
DEFAULT_SILENCE_S = 60.0
_KEY = "pipetrain-beat-{}"
_GONE = -(1 << 40)   # a rank that ended its run on purpose adds this: it is no longer expected to beat


def silence_s() -> float:
    try:
        value = float(os.environ.get(SILENCE_ENV, DEFAULT_SILENCE_S))
    except ValueError:
        return DEFAULT_SILENCE_S
    return value if value > 0 else DEFAULT_SILENCE_S


def _client():
    """A connection of this thread's own to the process group's store (the main thread's stays free for its own
    calls), or None without one."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store().clone()
        store.set_timeout(timedelta(seconds=max(1.0, silence_s() / 2)))
        return store
    except (AttributeError, RuntimeError, ValueError, NotImplementedError):
        return None


class PeerWatch:
    """``on_silent(rank, seconds, again)`` and ``on_answer(rank, seconds)`` are called from the thread: on global rank
    0 about every other rank, elsewhere about rank 0."""

    def __init__(self, rank: int, world: int, on_silent, on_answer):
        self.rank, self.world = rank, world
        self.on_silent, self.on_answer = on_silent, on_answer
        self.silence = silence_s()
        self.beat_s = min(5.0, self.silence / 4)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._store = None
        self._last_ok = time.monotonic()   # the last time this rank's own heartbeat reached the store

    def start(self) -> None:
        if self.world < 2:
            return
        self._store = _client()
        if self._store is None:
            return
        self._threads = [threading.Thread(target=self._beat, name="pipetrain-peer-beat", daemon=True),
                         threading.Thread(target=self._judge, name="pipetrain-peer-watch", daemon=True)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """This rank ends its part on purpose: it is not named as silent after it (best effort)."""
        if self._store is None or self._stop.is_set():
            return
        self._stop.set()
        try:
            self._store.set_timeout(timedelta(seconds=1))   # rank 0 may have ended already: no wait for it
            self._store.add(_KEY.format(self.rank), _GONE)
        except Exception:   # noqa: BLE001  (rank 0, the store's host, ended first: nobody left to tell)
            pass
        # the threads end before the interpreter does: one still inside a store call (native code) as the interpreter
        # shuts down is ended there and aborts the process (a finished rank then exits on SIGABRT)
        for thread in self._threads:
            thread.join(timeout=5.0)

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(_KEY.format(self.rank), 1)
                self._last_ok = time.monotonic()
            except Exception:   # noqa: BLE001  (the store timed out or went: the judge says so by the time)
                pass
            self._stop.wait(self.beat_s)

    def _judge(self) -> None:
        # per watched rank: [its last count, when it last moved, when it was last named (0: not named)]
        seen = {r: [None, time.monotonic(), 0.0] for r in (range(1, self.world) if self.rank == 0 else [0])}
        last_round = time.monotonic()
        while not self._stop.wait(self.beat_s):
            now = time.monotonic()
            if now - last_round > 3 * self.beat_s:   # this process was itself stopped: the others are not to blame
                for mark in seen.values():
                    mark[1] = now
                self._last_ok = now
            last_round = now
            for r, mark in seen.items():
                if self.rank == 0:
                    try:
                        count = self._store.add(_KEY.format(r), 0)
                    except Exception:   # noqa: BLE001
                        continue
                    if count < 0:   # ended on purpose
                        continue
                    if count != mark[0]:
                        mark[0], moved = count, mark[1]
                        mark[1] = now
                        if mark[2]:
                            mark[2] = 0.0
                            self._call(self.on_answer, r, now - moved)
                        continue
                else:   # rank 0 hosts the store: this rank's own heartbeat stops reaching it
                    if now - self._last_ok < self.beat_s * 2:
                        if mark[2]:
                            mark[2] = 0.0
                            self._call(self.on_answer, r, now - mark[1])
                        mark[1] = self._last_ok
                        continue
                silent = now - mark[1]
                if silent >= self.silence and (not mark[2] or silent >= 2 * mark[2]):
                    again = bool(mark[2])
                    mark[2] = silent
                    self._call(self.on_silent, r, silent, again)

    def _call(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:   # noqa: BLE001  (a report that fails, e.g. a full disk, must not end the watch)
            log.warning("peer watch: could not report: %s", e)
