"""Atomic file writes: a reader sees the old file or the complete new one, never a partial one."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """``durable=False`` skips the fsync: for files rewritten every step (status.json), where a reader needs a
    whole file, not one that survives a power cut, and an fsync costs milliseconds (more on network storage)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
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


def temp_path_beside(path: Path) -> Path:
    """A unique temporary name in the same folder (so ``os.replace`` stays atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)
