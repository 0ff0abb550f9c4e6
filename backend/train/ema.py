# SPDX-License-Identifier: GPL-3.0-or-later
"""``ema = true``: an exponential moving average of the trained weights (adapter or full fine-tune), kept by every
rank for its own stage's parameters, so it costs no communication.

After each optimizer step ``average = decay * average + (1 - decay) * weight``, starting from the weights before
the first step. The average is kept in float32 whatever the weights' dtype: at decay 0.999 one step moves it by a
thousandth of the difference, which a bfloat16 average (8 bits of mantissa) would round away. It is saved beside
the DeepSpeed checkpoint (one file per pipeline stage, under the parameters' names in the pipeline module, which
do not depend on the split), and written out by swapping it into the weights for the length of a save
(``applied``), so the EMA file has exactly the keys and format of the plain one.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn


CHUNK = 64   # parameters converted to float32 together in ``update``


def ema_file(folder: Path, stage: int) -> Path:
    return folder / f"ema_stage{stage:03d}.pt"


class WeightAverage:
    """The moving average of ``module``'s trainable parameters (those with ``requires_grad``)."""

    def __init__(self, module: nn.Module, decay: float):
        if not 0 < decay < 1:
            raise ValueError(f"ema decay {decay}: must be between 0 and 1")
        self.decay = decay
        self.names, self.params = [], []
        for name, p in module.named_parameters():
            if p.requires_grad:
                self.names.append(name)
                self.params.append(p)
        self.average = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """One step of the average towards the current weights (call after each optimizer step)."""
        for i in range(0, len(self.params), CHUNK):
            # float32 weights as they are; others converted a chunk at a time (a full fine-tune's stage in float32
            # at once could be more than the GPU has spare)
            current = [p.detach().float() for p in self.params[i:i + CHUNK]]
            torch._foreach_lerp_(self.average[i:i + CHUNK], current, 1.0 - self.decay)

    @contextmanager
    def applied(self):
        """The average in the weights (in their dtype) until the block ends, then the weights as they were, bit
        for bit (kept in CPU memory meanwhile: a full fine-tune's stage may not fit twice on the GPU)."""
        saved = [p.detach().to("cpu", copy=True) for p in self.params]
        try:
            with torch.no_grad():
                for p, a in zip(self.params, self.average):
                    p.copy_(a)
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.copy_(s)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: a.to("cpu") for name, a in zip(self.names, self.average)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """This stage's entries of ``state`` (the merged files of every stage); a parameter missing from it (a
        checkpoint of a run without EMA) starts its average at its current weight."""
        with torch.no_grad():
            for name, a, p in zip(self.names, self.average, self.params):
                a.copy_(state[name] if name in state else p)

    # --- in checkpoints -----------------------------------------------------------------------
    def save(self, folder: Path, stage: int) -> None:
        """Written by one data-parallel rank of each stage (the average is the same on all of them)."""
        torch.save(self.state_dict(), ema_file(folder, stage))

    def load(self, folder: Path) -> bool:
        """Every stage's file merged, so a resume with another split finds its parameters; False when the
        checkpoint holds none (it was written without ``ema``)."""
        files = sorted(folder.glob("ema_stage*.pt"))
        state = {}
        for f in files:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
        self.load_state_dict(state)
        return bool(files)
