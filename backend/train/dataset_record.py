"""What a checkpoint keeps of the training dataset, so that a resume on a dataset changed since (pictures deleted,
added or swapped) says so, naming how many items and where, instead of training on the rest silently. A record is
per folder: its number of items and a digest of their names (a count alone misses one picture swapped for another)."""
from __future__ import annotations

import hashlib
from collections import defaultdict
from pathlib import Path


def record(entries) -> dict[str, list]:
    """{folder: [items, digest of their sorted paths]} of the cache entries' pictures (or clips); an item trained
    at several sizes or with several captions counts once."""
    by_folder: dict[str, set[str]] = defaultdict(set)
    for e in entries:
        by_folder[str(Path(e.path).parent)].add(e.path)
    return {folder: [len(paths), hashlib.sha256("\n".join(sorted(paths)).encode()).hexdigest()]
            for folder, paths in sorted(by_folder.items())}


def _count(value) -> int | None:
    ok = isinstance(value, list) and len(value) == 2 and isinstance(value[0], int) and not isinstance(value[0], bool)
    return value[0] if ok else None


def changes(saved, now: dict[str, list]) -> list[str]:
    """Each difference of ``now`` from the checkpoint's record ``saved`` in words (empty: the same dataset, or a
    checkpoint from before records were kept)."""
    if not isinstance(saved, dict):
        return []
    said = []
    for folder in sorted(set(saved) | set(now)):
        before, after = _count(saved.get(folder)), (now.get(folder) or [0])[0]
        if folder in saved and before is None:
            continue   # not a record this code wrote
        before = before or 0
        if after < before:
            said.append(f"{before - after} of its {before} items are gone from {folder}")
        elif after > before:
            said.append(f"{after - before} items are new in {folder}" + (f" (it had {before})" if before else ""))
        elif saved.get(folder) != now.get(folder):
            said.append(f"items in {folder} were replaced by others (still {after})")
    return said
