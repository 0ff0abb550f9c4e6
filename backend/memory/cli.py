# SPDX-License-Identifier: GPL-3.0-or-later
"""``python -m pipetrain memory-plan run.toml``: each pipeline stage's GPU memory under the config's settings,
and what ``memory = "auto"`` would choose, before anything is cached or loaded (``memory/plan_config.py``)."""
from __future__ import annotations

from . import plan as mp


def gpu_total(cfg, gpu_gib: float | None = None, devices=None) -> tuple[int | None, bool]:
    """The bytes to plan for and whether they are a whole GPU: ``gpu_gib``, the config's memory_limit_gib, the
    smallest of ``devices`` (default: every GPU this process sees; indices it does not see are skipped), or
    (None, True) where none is left."""
    if gpu_gib is not None:
        return int(gpu_gib * mp.GIB), True
    if cfg.memory_limit_gib is not None:
        return int(cfg.memory_limit_gib * mp.GIB), False
    import torch
    if not torch.cuda.is_available():
        return None, True
    count = torch.cuda.device_count()
    sizes = [torch.cuda.get_device_properties(d).total_memory for d in (range(count) if devices is None else devices)
             if 0 <= d < count]
    return (min(sizes), True) if sizes else (None, True)


def main(config: str, resolution: int | None, frames: int | None, gpu_gib: float | None) -> int:
    from ..config import load_run_config
    from .plan_config import plan_config
    from ..host.runtime import ensure_comfyui

    cfg = load_run_config(config)
    ensure_comfyui()
    plan = plan_config(cfg, *gpu_total(cfg, gpu_gib), width=resolution, frames=frames)
    print("\n".join(plan.lines()))
    return 1 if plan.gpu_total is not None and plan.auto is None else 0
