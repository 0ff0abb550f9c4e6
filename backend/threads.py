# SPDX-License-Identifier: GPL-3.0-or-later
"""Many small file reads spread over a thread pool (reads and hashing release Python's interpreter lock)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def map_in_chunks(pool: ThreadPoolExecutor, fn: Callable[[T], R], items: list[T], chunk: int) -> Iterator[R]:
    """``fn(item)`` of every item, in order; the pool's threads take ``chunk`` items a task (a task per small file
    costs more in hand-overs than the file's own work)."""
    chunks = [items[i:i + chunk] for i in range(0, len(items), chunk)]
    for results in pool.map(lambda part: [fn(item) for item in part], chunks):
        yield from results

