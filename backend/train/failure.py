"""What a failed run says in its status and events: read by whoever reaches the panel (``/pipetrain/runs``), so
it names the run's own files and keys and never quotes what a file holds.

PipeTrain's own errors (``PipeTrainError``) are written that way. Any other exception is a library's (or a bug's):
its message may quote a value it read (``invalid literal for int() with base 10: '<a line of a file>'``) or name a
file the run was never given (a library's own files, a link's target). Its type and message are kept, every quoted
value and every path outside the run's own ones left out; the traceback, whole, goes to the run's log.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import PipeTrainError

_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted",
              "Broken pipe", "ProcessGroupNCCL", "Timed out")
_QUOTED = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"")
_PATH = re.compile(r"(?<![\w.~-])/[^\s'\",;:()\[\]]+")
LEFT_OUT, PATH_LEFT_OUT = "'…'", "<a path>"


def lost_peer(e: BaseException) -> bool:
    return not isinstance(e, PipeTrainError) and any(marker in str(e) for marker in _PEER_LOST)


def _own(text: str, own: tuple[Path, ...]) -> bool:
    path = Path(text)
    return path.is_absolute() and ".." not in path.parts and any(path.is_relative_to(o) for o in own)


def without_foreign_text(text: str, own: tuple[Path, ...] = ()) -> str:
    """``text`` with each quoted value, and each absolute path not under one of ``own``, left out."""
    own = tuple(Path(o) for o in own)
    text = _QUOTED.sub(lambda m: m[0] if _own(m[0][1:-1], own) else LEFT_OUT, text)
    return _PATH.sub(lambda m: m[0] if _own(m[0], own) else PATH_LEFT_OUT, text)


def explain_failure(e: BaseException, run_name: str, peer: tuple[int, str] | None = None,
                    own: tuple[Path, ...] = ()) -> str:
    """``peer``: (rank, reason) another rank told before it ended (``distributed.tell_failure``), the cause of a
    lost contact; ``own``: the run's folders and the files its config names, which a message may name."""
    if lost_peer(e) and peer is not None:
        return f"{peer[1]} (rank {peer[0]})"
    if isinstance(e, PipeTrainError):   # ours read as sentences, naming what the run was given
        return str(e)
    text = f"{type(e).__name__}: {without_foreign_text(str(e), own)}"
    if lost_peer(e):
        return (f"lost contact with another rank (a node or a training process stopped): {text.splitlines()[0]}. "
                f"The run is resumable from its last checkpoint: launch it again with --resume {run_name}")
    return f"{text} (its traceback is in the training log)"
