"""A torch.profiler record of a few training steps, for finding where a step's time goes.

``PIPETRAIN_PROFILE=<folder>[:first_step[:steps]]`` (default: steps 6 and 7) makes rank 0 record those
steps and write, into the folder, ``trace.json`` (Chrome/Perfetto), ``ops.txt`` (operators by GPU time, by CPU
time without a GPU) and ``summary.json``: wall time per step, the time in which a GPU kernel ran, their ratio,
and the longest stretches the GPU sat idle with the host operators open then (none: the host was in Python
between operators). The same number of steps after those are sampled on the host (``stack_sampler``), outside
the profiler, into ``host.txt``: which Python code a step's wall time went to (shares; sampling slows the host). A run that ends
inside the range writes only what was complete. An environment variable, not a config key: a diagnostic must
not change a run's config, its checkpoints or how it resumes.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

ENV = "PIPETRAIN_PROFILE"


def recorded_steps(steps: int) -> int:
    """Steps a ``steps``-step profile runs slower than the rest: the profiled ones, then the host-sampled ones."""
    return 2 * steps


def _kernel_spans(prof) -> list[tuple[float, float]]:
    from torch.autograd import DeviceType
    return sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)


def kernel_busy_us(prof) -> float:
    """Time in which at least one GPU kernel ran (overlapping kernels counted once), in microseconds."""
    busy, end = 0.0, float("-inf")
    for s, e in _kernel_spans(prof):
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy


def idle_gaps(prof, top: int = 8, min_us: float = 500.0) -> list[dict]:
    """The longest stretches with no kernel running between the first and the last kernel, each with the host
    operators open at its middle (outermost first): what the GPU was waiting for."""
    from torch.autograd import DeviceType

    gaps, end = [], None
    for s, e in _kernel_spans(prof):
        if end is not None and s - end >= min_us:
            gaps.append((end, s))
        end = e if end is None else max(end, e)
    host = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    out = []
    for start, stop in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        middle = (start + stop) / 2
        open_ops = sorted((e for e in host if e.time_range.start <= middle <= e.time_range.end),
                          key=lambda e: e.time_range.start)
        out.append({"ms": round((stop - start) / 1e3, 2), "host": [e.name[:80] for e in open_ops][:8]})
    return out


def write_profile(prof, folder: Path, steps: int, wall_s: float) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(folder / "trace.json"))
    by = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    (folder / "ops.txt").write_text(prof.key_averages().table(sort_by=by, row_limit=50))
    busy_us = kernel_busy_us(prof)
    summary = {"steps": steps, "wall_ms_per_step": round(wall_s * 1e3 / steps, 1),
               "kernel_busy_ms_per_step": round(busy_us / 1e3 / steps, 1),
               "gpu_busy": round(busy_us / (wall_s * 1e6), 3)}
    (folder / "summary.json").write_text(json.dumps({**summary, "idle_gaps": idle_gaps(prof)}, indent=1))
    return summary


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepProfiler:
    """Records steps ``first`` .. ``first + steps - 1`` (1-based, as the step events count them) with
    torch.profiler, then samples the host for as many steps."""

    def __init__(self, folder: Path, first: int, steps: int):
        self.folder, self.first, self.steps = folder, first, steps
        self._prof, self._sampler, self._started = None, None, 0.0
        self._summary: dict = {}

    @classmethod
    def from_env(cls, rank: int) -> "StepProfiler | None":
        value = os.environ.get(ENV)
        if not value or rank != 0:
            return None
        folder, *numbers = value.split(":")
        try:
            first = int(numbers[0]) if numbers else 6
            steps = int(numbers[1]) if len(numbers) > 1 else 2
        except ValueError:
            raise ValueError(f"{ENV}={value!r}: expected <folder>[:first_step[:steps]] with whole numbers") from None
        return cls(Path(folder), max(first, 1), max(steps, 1))

    def before_step(self, step: int) -> None:
        """``step``: the step about to run."""
        if step == self.first and self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            _synchronize()
            self._prof = profile(activities=activities, record_shapes=True)
            self._prof.__enter__()
            self._started = time.perf_counter()
        elif step == self.first + self.steps and self._summary and self._sampler is None:
            from .stack_sampler import HostSampler

            _synchronize()
            self._sampler = HostSampler().__enter__()
            self._started = time.perf_counter()

    def after_step(self, step: int) -> dict | None:
        """``step``: the step just issued; returns the summary once the host-sampled steps have run too."""
        if self._prof is not None and step == self.first + self.steps - 1:
            _synchronize()
            wall = time.perf_counter() - self._started
            self._prof.__exit__(None, None, None)
            self._summary = write_profile(self._prof, self.folder, self.steps, wall)
            self._prof = None
        elif self._sampler is not None and step == self.first + 2 * self.steps - 1:
            _synchronize()
            wall = time.perf_counter() - self._started
            self._sampler.__exit__(None, None, None)
            (self.folder / "host.txt").write_text(self._sampler.report(wall, self.steps))
            self._sampler = None
            return {**self._summary, "host_ms_per_step": round(wall * 1e3 / self.steps, 1)}
        return None
