# SPDX-License-Identifier: GPL-3.0-or-later
"""A run config's memory plan before anything is cached or loaded: the model traced on the meta device at the
dataset's largest size (``memory_plan.trace_run`` with probe captions), each stage's figure under the config's own
settings, and what ``memory = "auto"`` would choose on a GPU of a given size.

Three callers: ``python -m pipetrain memory-plan``, ``doctor --config`` and the launcher when a run is queued
(the Train node shows the plan, and an ``auto`` run that nothing fits is refused there, before its processes
start). A trace of a full-size model costs seconds of CPU, so the traced footprints are kept in a memo folder
keyed by everything they depend on (the model file's identity, the type and dtypes, the adapter, the micro-batch's
shape); a second plan for the same model and size is instant.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from . import plan as mp
from ..models.meta_trace import LayerFootprint


@dataclass(frozen=True)
class Probe:
    """The micro-batch a plan traces: the dataset's largest bucket."""
    width: int
    height: int
    frames: int
    batch: int

    def describe(self) -> str:
        return f"{self.width}x{self.height}" + (f"x{self.frames} frames" if self.frames > 1 else "") + \
            f", micro-batch {self.batch}"


@dataclass(frozen=True)
class ConfigPlan:
    model_type: str
    probe: Probe
    stages: int
    configured: tuple[mp.MemorySettings, list[mp.StageEstimate]]
    gpu_total: int | None          # bytes planned for (a GPU's total, or memory_limit_gib), None: unknown
    whole_gpu: bool
    auto: tuple[mp.MemorySettings, list[mp.StageEstimate]] | None   # what 'auto' chooses (None: nothing fits)
    refusal: str | None            # why nothing fits, with the changes that would help

    def peak(self) -> int:
        return mp.peak(self.configured[1])

    def lines(self) -> list[str]:
        out = [f"{self.model_type} at {self.probe.describe()}, {self.stages} stage(s)",
               "as configured: " + mp.report(*self.configured)]
        if self.gpu_total is None:
            out.append("memory = 'auto': no GPU here; give the GPU's size (--gpu-gib) to see its choice")
        elif self.auto is None:
            out.append(f"memory = 'auto': {self.refusal}")
        else:
            out.append(f"memory = 'auto' on {self.gpu_total / mp.GIB:.1f} GiB: " + mp.report(*self.auto, self.gpu_total))
        return out

    def summary(self) -> str:
        """One line for a node: the configured peak, and whether it fits the GPU."""
        text = f"memory plan: {mp.gib(self.peak())} per stage at {self.probe.describe()}"
        if self.gpu_total is None:
            return text
        usable = mp.usable_bytes(self.gpu_total, self.whole_gpu)
        text += f" ({mp.gib(self.gpu_total)} GPU)"
        if self.peak() > usable:
            text += "; likely out of memory as configured: " + (
                f"memory = 'auto' would choose {self.auto[0].describe()}" if self.auto else self.refusal)
        return text


def largest_probe(cfg, width: int | None = None, frames: int | None = None) -> Probe:
    """The dataset's largest bucket (resolutions, size_buckets and frame buckets of every directory), or the
    given side and frame count."""
    from ..data.epoch_plan import micro_batch_for

    ds = cfg.dataset_config
    sides = [r for d in ds.directory for r in (d.resolutions or [])] + list(ds.resolutions)
    size_buckets = [b for d in ds.directory for b in (d.size_buckets or [])] + list(ds.size_buckets or [])
    sizes = [(s, s) for s in sides] + [tuple(b[:2]) for b in size_buckets]
    clips = [f for d in ds.directory for f in (d.frame_buckets or [])] + list(ds.frame_buckets) + \
        [b[2] for b in size_buckets if len(b) > 2]
    w, h = (width, width) if width else max(sizes, key=lambda s: s[0] * s[1])
    clip = frames or max(clips)
    from ..train.preservation import PARTS

    # diff_output_preservation: the pipeline carries each sample's two preservation rows too
    rows = PARTS if cfg.diff_output_preservation else 1
    batch = micro_batch_for(cfg, (w, h, clip) if clip > 1 else (w, h)) * rows
    return Probe(int(w), int(h), int(clip), int(batch))


def _memo_key(cfg, probe: Probe) -> str:
    try:
        st = os.stat(cfg.model.diffusion_model)
        identity = [st.st_size, st.st_mtime_ns]
    except OSError:
        identity = None
    parts = {"model": dataclasses.asdict(cfg.model), "file": identity, "probe": dataclasses.asdict(probe),
             "adapter": dataclasses.asdict(cfg.adapter) if cfg.adapter is not None else None}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def footprints(cfg, probe: Probe, memo: Path | None = None) -> list[LayerFootprint]:
    """The traced footprints of ``cfg``'s model at ``probe``, from ``memo`` when traced before."""
    path = memo / f"{_memo_key(cfg, probe)}.json" if memo is not None else None
    if path is not None and path.is_file():
        try:
            return [LayerFootprint(**row) for row in json.loads(path.read_text())]
        except (ValueError, TypeError):
            pass   # a memo from another version of the fields: traced again and rewritten
    from ..models.meta_trace import probe_inputs

    traced = mp.trace_run(cfg, lambda adapter: probe_inputs(adapter, probe.width, probe.height, probe.frames,
                                                            probe.batch))
    if path is not None:
        from ..fsutil import atomic_write_json
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, [dataclasses.asdict(fp) for fp in traced], durable=False)
    return traced


def plan_config(cfg, gpu_total: int | None, whole_gpu: bool = True, width: int | None = None,
                frames: int | None = None, memo: Path | None = None) -> ConfigPlan:
    probe = largest_probe(cfg, width, frames)
    traced = footprints(cfg, probe, memo)
    training = mp.training_of(cfg)
    settings = mp.settings_of(cfg)
    configured = (settings, mp.estimate(traced, settings, training))
    auto, refusal = None, None
    if gpu_total is not None:
        auto = mp.choose(traced, training, gpu_total, whole_gpu)
        if auto is None:
            refusal = mp.does_not_fit(cfg, traced, gpu_total, whole_gpu)
    return ConfigPlan(cfg.model.type, probe, cfg.pipeline_stages, configured, gpu_total, whole_gpu, auto, refusal)
