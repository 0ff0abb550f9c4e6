"""Learning-rate schedules as a multiplier of the base LR per optimizer step."""
from __future__ import annotations

import math


def lr_multiplier(kind: str, warmup_steps: int, total_steps: int):
    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        if kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        raise ValueError(kind)
    return f


def set_base_lr(scheduler, lr: float) -> None:
    """Train with base learning rate ``lr`` from the next optimizer step on: the schedule's multiplier (warm-up,
    decay) goes on applying, now to ``lr``. ``scheduler`` is the run's ``LambdaLR``; its ``base_lrs`` are in its
    state dict, so a checkpoint keeps the change. Further parameter groups keep their ratio to the first."""
    first = scheduler.base_lrs[0]
    scheduler.base_lrs = [lr] + [base * lr / first if first else lr for base in scheduler.base_lrs[1:]]
    # the step just taken has already set each group's rate for the next one: set it again, from the new base
    for group, base, multiplier in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * multiplier(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
