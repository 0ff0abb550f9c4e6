"""Atomic file writes: a reader sees the old file or the complete new one, never a partial one; and bounded reads
of files a user (or a workflow) names."""
from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from .errors import PipeTrainError


class UnreadableFile(ValueError):
    """Why a named file is not read: its message is the problem alone (the caller names the file and key);
    ``missing``: there is no such file."""

    def __init__(self, problem: str, missing: bool = False):
        super().__init__(problem)
        self.missing = missing


def user_cache_dir() -> Path:
    """PipeTrain's folder in the user's cache (``$XDG_CACHE_HOME/pipetrain``, else ``~/.cache/pipetrain``): what
    one run learns that the next may reuse (ComfyUI parity verdicts, model files' digests)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "pipetrain"


def read_regular(path: str | Path, limit: int) -> bytes:
    """A regular file's bytes, at most ``limit``; ``UnreadableFile`` for anything else. A device (/dev/zero),
    a FIFO or a folder is refused before a byte is read, on the opened file itself (no swap between a check
    and the read): reading one could fill memory or block for ever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UnreadableFile("not found", missing=True) from None
    except IsADirectoryError:
        raise UnreadableFile("not a regular file (a folder)") from None
    except OSError as e:       # no permission, a name too long, ...
        raise UnreadableFile(f"cannot be read ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnreadableFile("not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise UnreadableFile(f"cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UnreadableFile(f"larger than {limit // 1024} KiB")
    return data


# held while a file is written under a temporary name and renamed into place: a process that must end at once
# (caching cancelled, ``exit_between_writes``) takes it first, so no temporary file is left behind
WRITES = threading.RLock()


def exit_between_writes(code: int) -> None:
    """End this process now (no clean-up, no atexit work), but not in the middle of an atomic write."""
    WRITES.acquire()
    os._exit(code)


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """``durable=False`` skips the fsync: for files rewritten every step (status.json), where a reader needs a
    whole file, not one that survives a power cut, and an fsync costs milliseconds (more on network storage)."""
    with WRITES:
        _atomic_write_bytes(path, data, durable)


def _atomic_write_bytes(path: Path, data: bytes, durable: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            fault_point(f"write:{path.name}")
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj, durable: bool = True) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode(), durable)


# the exit status of a PipeTrain process that stopped on a full disk (its parent, e.g. the run that started the
# sample renderer, reports the full disk rather than a failed child)
OUT_OF_SPACE_EXIT = 28


class OutOfSpace(PipeTrainError):
    def __init__(self, folder: Path):
        super().__init__(f"no space left in {folder}: free space there (or point output_dir, lora_dir or the "
                         "cache elsewhere), then start the run again or resume it with --resume")
        self.folder = folder


def is_out_of_space(e: BaseException, folder: Path) -> bool:
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    if "No space left on device" in str(e):   # safetensors' writer: SafetensorError with the OS message
        return True
    # torch's writer says only that it failed, and a rank writing into a folder beside another sees that one end
    # (a lost peer) when the other's write ran out of space: with the disk nearly full, both are the full disk
    if isinstance(e, RuntimeError):
        try:
            return shutil.disk_usage(folder).free < _NEARLY_FULL
        except OSError:
            return False
    return False


_NEARLY_FULL = 64 << 20


@contextmanager
def space_guard(folder: Path, *partial: Path):
    """Turns a full disk while writing under ``folder`` into ``OutOfSpace`` naming it, after removing the
    ``partial`` files or folders the failed write leaves (which also makes room for the failed status)."""
    try:
        yield
    except BaseException as e:
        if not is_out_of_space(e, folder):
            raise
        for path in partial:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        raise OutOfSpace(folder) from None


def rewrite_in_place(path: Path, data: bytes) -> None:
    """Last resort on a full disk, where even a small file's temporary copy finds no room: truncate ``path`` and
    write ``data`` into the space it held. A kill in between leaves it cut; only the run's final status, written
    once as the run fails, takes that risk rather than never being written."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)


@contextmanager
def exclusive(lock_file: Path):
    """Hold an advisory lock on ``lock_file`` (made when missing) across processes: two processes that write the
    same shared files (the tiny model files of two test workers, two demos) take turns, and the second sees the
    first's finished result."""
    import fcntl

    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def temp_path_beside(path: Path) -> Path:
    """A unique temporary name in the same folder (so ``os.replace`` stays atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


# --- fault injection (tests only) ---------------------------------------------------------------------------
# PIPETRAIN_KILL_AT="<point>:<n>" SIGKILLs this process's whole process group at the n-th time this process
# passes the named save/rename point (``fault_point``), so a test can stop a run exactly between two writes.
# PIPETRAIN_FULL_AT="<point>:<n>[@<rank>]" makes the disk full there instead: from the n-th pass on (a full disk
# stays full), the point raises the OS's ENOSPC (on global rank <rank> only, when given). ``atomic_write_bytes``
# passes "write:<file name>" after its temporary file is made, before its bytes are written.
# Unset (always, outside tests) each costs one dictionary look-up per write.
KILL_AT_ENV = "PIPETRAIN_KILL_AT"
FULL_AT_ENV = "PIPETRAIN_FULL_AT"
_passed: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get(KILL_AT_ENV)
    if spec:
        point, _, nth = spec.rpartition(":")
        if point == name:
            _passed[name] = _passed.get(name, 0) + 1
            if _passed[name] == int(nth):
                import signal
                os.killpg(os.getpgid(0), signal.SIGKILL)
    spec = os.environ.get(FULL_AT_ENV)
    if spec:
        spec, _, rank = spec.partition("@")
        point, _, nth = spec.rpartition(":")
        if point == name and (not rank or os.environ.get("RANK", "0") == rank):
            key = f"full:{name}"
            _passed[key] = _passed.get(key, 0) + 1
            if _passed[key] >= int(nth):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
