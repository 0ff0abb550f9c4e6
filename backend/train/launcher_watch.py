"""Ranks end when their DeepSpeed launcher ends. DeepSpeed's runner starts ``deepspeed.launcher.launch``, which
starts the ranks; a SIGKILL to either (a killed terminal, the OOM killer, a stop that could not wait) leaves
ranks that train on with nobody to stop them and keep the run folder. A daemon thread in each rank polls
the DeepSpeed processes above it on this machine and exits the rank, without a checkpoint, once one is gone.
Only processes running DeepSpeed's launcher are watched: ComfyUI, a shell or ssh above them may come and go."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

POLL_S = 1.0
_MAX_DEPTH = 4


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a live process, None once it is gone (Linux /proc)."""
    try:
        text = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()   # the name in parentheses may hold spaces
    if fields[0] == "Z":   # a zombie has exited; only its parent has not reaped it yet
        return None
    return int(fields[1]), fields[19]


def _runs_deepspeed(pid: int) -> bool:
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return False
    if any(arg.startswith(b"deepspeed.launcher") or arg.endswith(b"/deepspeed") for arg in argv):
        return True
    # ``python -m pipetrain deepspeed`` (process/deepspeed_cli.py): DeepSpeed's runner in PipeTrain's entry file
    return any(a.endswith(b"__main__.py") and b == b"deepspeed" for a, b in zip(argv, argv[1:]))


def deepspeed_ancestors() -> list[tuple[int, str]]:
    """(pid, start time) of every DeepSpeed launcher process above this one, nearest first."""
    found, pid = [], os.getpid()
    for _ in range(_MAX_DEPTH):
        stat = _stat(pid)
        if stat is None or stat[0] <= 1:
            break
        pid = stat[0]
        parent = _stat(pid)
        if parent is None or not _runs_deepspeed(pid):
            break
        found.append((pid, parent[1]))
    return found


class LauncherWatch:
    """The DeepSpeed launcher processes above this rank; ``start`` polls them from a daemon thread."""

    def __init__(self):
        self.watched = deepspeed_ancestors()

    def gone(self) -> int | None:
        """The pid of a watched launcher that has ended (the start time tells a reused pid apart), else None."""
        for pid, started in self.watched:
            stat = _stat(pid)
            if stat is None or stat[1] != started:
                return pid
        return None

    def start(self, on_gone: Callable[[int], None]) -> None:
        """Calls ``on_gone(pid)`` from the thread once a launcher has ended; ``on_gone`` is expected not to
        return."""
        if not self.watched:
            return

        def poll():
            while (pid := self.gone()) is None:
                time.sleep(POLL_S)
            on_gone(pid)

        threading.Thread(target=poll, name="pipetrain-launcher-watch", daemon=True).start()
