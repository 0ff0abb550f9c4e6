# SPDX-License-Identifier: GPL-3.0-or-later
"""The loss between the network's prediction and the objective's target (the run's ``loss_type``).

``mse`` is the default and diffusion-pipe's; ``l1``, ``huber`` (``huber_delta``) and ``smooth_l1``
(``smooth_l1_beta``) are the element-wise losses ComfyUI's own trainer offers, diffusion-pipe's ``huber_delta`` /
``smooth_l1_beta`` keys choosing the last two there. Computed in float32 at least. Per-sample weights (SDXL's
min-SNR / debiased estimation, ``objectives.DiscreteDiffusion.loss_weights``) scale each sample's mean loss
before the mean over the batch, as diffusion-pipe weighs them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = ("mse", "l1", "huber", "smooth_l1")


@dataclass(frozen=True)
class Loss:
    kind: str = "mse"
    huber_delta: float = 1.0        # huber: quadratic below delta, linear (slope delta) above
    smooth_l1_beta: float = 1.0     # smooth_l1: quadratic (divided by beta) below beta, |e| - beta / 2 above

    def __post_init__(self):
        if self.kind not in LOSS_TYPES:
            raise ValueError(f"loss {self.kind!r}: one of {LOSS_TYPES}")

    @classmethod
    def from_config(cls, cfg) -> "Loss":
        """The loss a ``RunConfig`` asks for (``RunConfig.loss_kind`` resolves diffusion-pipe's spelling)."""
        return cls(cfg.loss_kind, huber_delta=1.0 if cfg.huber_delta is None else cfg.huber_delta,
                   smooth_l1_beta=1.0 if cfg.smooth_l1_beta is None else cfg.smooth_l1_beta)

    def elementwise(self, pred: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
        if self.kind == "mse":
            return F.mse_loss(pred, target, reduction=reduction)
        if self.kind == "l1":
            return F.l1_loss(pred, target, reduction=reduction)
        if self.kind == "huber":
            return F.huber_loss(pred, target, reduction=reduction, delta=self.huber_delta)
        return F.smooth_l1_loss(pred, target, reduction=reduction, beta=self.smooth_l1_beta)

    def __call__(self, pred: torch.Tensor, target: torch.Tensor,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        dtype = torch.promote_types(pred.dtype, torch.float32)
        pred, target = pred.to(dtype), target.to(dtype)
        if weights is None:   # one reduction over everything: the mean of equal-sized samples' means
            return self.elementwise(pred, target, "mean")
        per_sample = self.elementwise(pred, target, "none").flatten(1).mean(1)
        return (per_sample * weights.to(per_sample.device, dtype)).mean()
