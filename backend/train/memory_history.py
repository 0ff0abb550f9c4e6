# SPDX-License-Identifier: GPL-3.0-or-later
"""Where a run's GPU memory is when it runs out: a diagnostic for plans that fit on paper and not on the GPU.

``PIPETRAIN_MEMORY_HISTORY=<folder>`` makes rank 0 record the CUDA allocator's history (each allocation with its
Python stack) from the first step on. When a step runs out of memory, or after the step it names
(``<folder>:<step>``), the rank writes ``memory.txt`` into the folder: the live tensors grouped by the code that
made them (the innermost frames of PipeTrain and ComfyUI in each allocation's stack), largest first, with the
allocator's totals per CUDA stream. Tensors made before recording began (the model's weights) show as such. An
environment variable, not a config key, as ``PIPETRAIN_PROFILE``: a diagnostic never changes a run.
"""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import torch

ENV = "PIPETRAIN_MEMORY_HISTORY"
MAX_ENTRIES = 200_000      # allocator events kept (a ring): enough for a step of a large model
OURS = ("pipetrain", "/backend/", "/comfy/", "/comfy_extras/", "deepspeed/")
GIB = 2 ** 30


def owner(frames: list[dict], depth: int = 3) -> str:
    """The allocation's place: its innermost ``depth`` frames in PipeTrain, ComfyUI or DeepSpeed code (shortened
    paths), or its innermost frame where none is."""
    ours = [f for f in frames if any(mark in f.get("filename", "") for mark in OURS)]
    chosen = ours[:depth] or frames[:1]
    if not chosen:
        return "(allocated before recording began)"
    return " < ".join(f"{_short(f['filename'])}:{f['line']} {f['name']}" for f in chosen)


def _short(path: str) -> str:
    for mark in ("/backend/", "/comfy/", "/comfy_extras/", "/deepspeed/", "/torch/"):
        if mark in path:
            return mark.strip("/") + "/" + path.split(mark, 1)[1]
    return Path(path).name


def summary(snapshot: dict, top: int = 40) -> str:
    """``snapshot`` (``torch.cuda.memory._snapshot()``) as text: live bytes per owner, then totals per stream."""
    by_owner: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    streams: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for segment in snapshot.get("segments", []):
        stream = segment.get("stream", 0)
        streams[stream]["reserved"] += segment.get("total_size", 0)
        for block in segment.get("blocks", []):
            state = block.get("state", "")
            streams[stream][state] += block.get("size", 0)
            if state.startswith("active"):
                entry = by_owner[owner(block.get("frames", []))]
                entry[0] += block.get("size", 0)
                entry[1] += 1
    live = sum(size for size, _ in by_owner.values())
    lines = [f"live tensors: {live / GIB:.3f} GiB"]
    for name, (size, count) in sorted(by_owner.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{size / GIB:8.3f} GiB {count:6d}x  {name}")
    lines.append("per CUDA stream (GiB): " + "; ".join(
        f"stream {s}: " + ", ".join(f"{k} {v / GIB:.3f}" for k, v in sorted(states.items()))
        for s, states in streams.items()))
    return "\n".join(lines)


class MemoryHistory:
    """Rank 0's allocator recording for ``PIPETRAIN_MEMORY_HISTORY`` (None elsewhere, and without CUDA)."""

    def __init__(self, folder: Path, after_step: int | None):
        self.folder, self.after_step, self.written = folder, after_step, False

    @classmethod
    def from_env(cls, rank: int) -> "MemoryHistory | None":
        value = os.environ.get(ENV)
        if not value or rank != 0 or not torch.cuda.is_available():
            return None
        folder, _, step = value.partition(":")
        if step and not step.isdigit():
            raise ValueError(f"{ENV}={value!r}: expected <folder>[:step] with a whole number")
        torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
        return cls(Path(folder), int(step) if step else None)

    def write(self, reason: str) -> None:
        if self.written:
            return
        self.written = True
        self.folder.mkdir(parents=True, exist_ok=True)
        text = (f"{reason}\nallocated {torch.cuda.memory_allocated() / GIB:.3f} GiB, reserved "
                f"{torch.cuda.memory_reserved() / GIB:.3f} GiB, peak allocated "
                f"{torch.cuda.max_memory_allocated() / GIB:.3f} GiB\n" + summary(torch.cuda.memory._snapshot()))
        (self.folder / "memory.txt").write_text(text + "\n")

    def after(self, step: int) -> None:
        if self.after_step is not None and step == self.after_step:
            self.write(f"after step {step}")
