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
