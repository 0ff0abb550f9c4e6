# SPDX-License-Identifier: GPL-3.0-or-later
"""``pipeline_stages`` left to the launcher (the Parallelism node's 0, or no Parallelism node): the fewest stages
that divide the run's ranks and whose every stage fits the GPU, by the memory planner's trace
(``backend/memory/plan_config.py``).

Fewest, because each stage more is a pipeline bubble more, while the ranks it frees train data parallel. Where
there is no GPU memory to plan for (CPU ranks, a cluster with no ``memory_limit_gib``), one stage; where no
divisor fits, every rank a stage (the queue-time plan then says what does not fit).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from ..backend.errors import PipeTrainError

log = logging.getLogger(__name__)


def divisors(world: int) -> list[int]:
    return [s for s in range(1, world + 1) if world % s == 0]


def planned_stages(run_toml: Path, devices: tuple[int, ...] | None, world: int, memo: Path) -> tuple[int, str]:
    """(stages, why) for the run written at ``run_toml`` on ``world`` ranks; ``devices`` None: a cluster's."""
    if world <= 1:
        return 1, "one rank"
    from ..backend.memory import plan as mp
    from ..backend.config import load_run_config
    from ..backend.memory.cli import gpu_total
    from ..backend.memory.plan_config import footprints, largest_probe

    cfg = load_run_config(run_toml)
    total, whole = gpu_total(cfg, devices=() if devices is None else devices)
    if total is None:
        return 1, "no GPU memory to plan for"
    try:
        traced = footprints(cfg, largest_probe(cfg), memo)
    except PipeTrainError as e:
        return 1, f"not planned: {e}"
    except Exception as e:  # noqa: BLE001  (model code the trace cannot run must not block the run)
        log.warning("pipeline stages: the trace failed", exc_info=True)
        return 1, f"not planned: this model could not be traced ({type(e).__name__})"
    training = mp.training_of(cfg)
    for stages in divisors(world):
        if stages <= len(traced) and mp.choose(traced, dataclasses.replace(training, stages=stages), total, whole):
            return stages, f"the fewest that fit {mp.gib(total)} per GPU"
    return world, f"none fits {mp.gib(total)} per GPU: one stage per GPU"
