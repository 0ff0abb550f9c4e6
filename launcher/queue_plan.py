# SPDX-License-Identifier: GPL-3.0-or-later
"""The memory plan of a run as it is queued (``backend/memory/plan_config.py``), for the Train node.

The plan is computed in this process, before the run's processes start: a ``memory = "auto"`` run that nothing
fits is refused here with the smallest change that would fit, instead of minutes later in its log; any other run
shows its planned peak per stage and, where it exceeds the GPU, what ``auto`` would choose. The trace runs in the
ComfyUI process while the Train node executes (ComfyUI runs one node at a time, and the trace only swaps
attention for a stand-in during its own forward); the footprints are memoised beside the runs, so queueing the
same model and size again costs nothing.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from ..backend.errors import PipeTrainError

log = logging.getLogger(__name__)
MEMO_FOLDER = ".memory_plans"


@dataclass(frozen=True)
class QueuePlan:
    text: str              # one line for the Train node
    refusal: str | None    # set for an 'auto' run that no setting fits


def plan_queued_run(run_toml: Path, devices: tuple[int, ...] | None, runs_root: Path) -> QueuePlan:
    """The plan of the run written at ``run_toml``; a model the trace cannot run is reported, not refused (the
    run then trains with its config's own settings, as ``memory = 'auto'`` does after a failed trace)."""
    from ..backend.memory import plan as mp
    from ..backend.config import load_run_config
    from ..backend.memory.cli import gpu_total
    from ..backend.memory.plan_config import plan_config

    cfg = load_run_config(run_toml)
    start = time.monotonic()
    try:
        # a cluster's GPUs (devices None) are not this machine's: only memory_limit_gib is known for them
        plan = plan_config(cfg, *gpu_total(cfg, devices=() if devices is None else devices),
                           memo=runs_root / MEMO_FOLDER)
    except PipeTrainError as e:
        return QueuePlan(f"memory plan: not made ({e})", None)
    except Exception as e:  # noqa: BLE001  (model code the trace cannot run must not block the run)
        log.warning("memory plan at queue time failed", exc_info=True)
        return QueuePlan(f"memory plan: this model could not be traced ({type(e).__name__})", None)
    took = f" (planned in {time.monotonic() - start:.1f} s)"
    if cfg.memory == "auto" and plan.gpu_total is not None:
        if plan.auto is None:
            return QueuePlan(plan.summary(), f"memory = 'auto': {plan.refusal}")
        return QueuePlan(f"memory = 'auto' chooses {plan.auto[0].describe()}: {mp.gib(mp.peak(plan.auto[1]))} per "
                         f"stage of {mp.gib(plan.gpu_total)} at {plan.probe.describe()}" + took, None)
    return QueuePlan(plan.summary() + took, None)
