# SPDX-License-Identifier: GPL-3.0-or-later
"""Child processes that end with the process that started them: a run's sample renderer must not outlive a run
killed or failed meanwhile and write into its folder. The parent names itself in the child's environment; the
child asks Linux to kill it when that parent ends (``PR_SET_PDEATHSIG``), then checks that the parent has not
already ended."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "PIPETRAIN_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env() -> dict[str, str]:
    """This process's environment, naming this process as the parent to die with."""
    return {**os.environ, PARENT_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """In a child started with ``child_env``: end (SIGKILL) when the parent ends. Outside Linux, or started
    otherwise, nothing."""
    expected = os.environ.pop(PARENT_ENV, "")
    if not expected.isdigit() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != int(expected):   # the parent ended before the request above: nothing will signal
        os._exit(1)
