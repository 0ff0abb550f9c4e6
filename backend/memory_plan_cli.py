# SPDX-License-Identifier: GPL-3.0-or-later
"""``python -m pipetrain memory-plan run.toml``: each pipeline stage's GPU memory under the config's settings,
and what ``memory = "auto"`` would choose, before anything is cached or loaded (the model is traced on the meta
device at the dataset's largest resolution and frame count, with probe captions)."""
from __future__ import annotations

from . import memory_plan as mp


def _largest(cfg) -> tuple[int, int]:
    ds = cfg.dataset_config
    sizes = [r for d in ds.directory for r in (d.resolutions or [])] + list(ds.resolutions)
    frames = [f for d in ds.directory for f in (d.frame_buckets or [])] + list(ds.frame_buckets)
    return max(sizes), max(frames)


def _gpu_total(cfg, gpu_gib: float | None) -> tuple[int | None, bool]:
    if gpu_gib is not None:
        return int(gpu_gib * mp.GIB), True
    if cfg.memory_limit_gib is not None:
        return int(cfg.memory_limit_gib * mp.GIB), False
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, True
    return None, True


def main(config: str, resolution: int | None, frames: int | None, gpu_gib: float | None) -> int:
    from .config import load_run_config
    from .models.meta_trace import probe_inputs
    from .runtime import ensure_comfyui

    cfg = load_run_config(config)
    ensure_comfyui()
    size, clip = _largest(cfg)
    size, clip = resolution or size, frames or clip
    from .data.epoch_plan import micro_batch_for
    batch = micro_batch_for(cfg, (size, size, clip) if clip > 1 else (size, size))
    footprints = mp.trace_run(cfg, lambda adapter: probe_inputs(adapter, size, size, clip, batch))
    training = mp.training_of(cfg)
    print(f"{cfg.model.type} at {size}x{size}" + (f"x{clip} frames" if clip > 1 else "") +
          f", micro-batch {batch}, {cfg.pipeline_stages} stage(s)")
    print("as configured: " + mp.report(mp.settings_of(cfg), mp.estimate(footprints, mp.settings_of(cfg), training)))
    total, whole_gpu = _gpu_total(cfg, gpu_gib)
    if total is None:
        print("memory = 'auto': no GPU here; give --gpu-gib to see its choice for a GPU of that size")
        return 0
    chosen = mp.choose(footprints, training, total, whole_gpu)
    if chosen is None:
        print(f"memory = 'auto': {mp.does_not_fit(cfg, footprints, total, whole_gpu)}")
        return 1
    print(f"memory = 'auto' on {total / mp.GIB:.1f} GiB: " + mp.report(*chosen, total))
    return 0
