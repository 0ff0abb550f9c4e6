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


def make_scheduler(cfg, total_steps: int):
    """The run's schedule, built on the optimizer DeepSpeed made: ``LambdaLR`` over ``lr_multiplier``, or with
    ``force_constant_lr`` (diffusion-pipe's) a constant one with every group's rate set to it."""
    import torch

    def build(optimizer):
        if cfg.force_constant_lr is None:
            return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg.lr_scheduler, cfg.warmup_steps,
                                                                              total_steps))
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] = cfg.force_constant_lr
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier("constant", 0, total_steps))
    return build


def force_rates(scheduler, lr: float) -> None:
    """After a resume loaded a checkpoint's rates and schedule: every group at ``lr`` again, on the constant
    schedule (diffusion-pipe's ``force_constant_lr`` on resume)."""
    scheduler.base_lrs = [lr] * len(scheduler.optimizer.param_groups)
    for group in scheduler.optimizer.param_groups:
        group["lr"] = group["initial_lr"] = lr
    scheduler._last_lr = [lr] * len(scheduler.optimizer.param_groups)
