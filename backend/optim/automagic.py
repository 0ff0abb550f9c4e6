# SPDX-License-Identifier: GPL-3.0-or-later
"""``Automagic``: diffusion-pipe's ``type = 'automagic'`` (ai-toolkit's optimizer of that name), written here from
its published behaviour, with its argument names.

Each weight element has its own learning rate. The step direction is Adafactor's: the gradient divided by the
square root of a running mean of squared gradients (factored into row and column means for matrices, as
Adafactor stores them, so a matrix costs rows + columns floats instead of a full second copy), with ``eps``
(the first of a pair, as Adafactor's pair is given) added to the squared gradient, then scaled down so its
root-mean-square is at most ``clip_threshold``. The element's learning rate then moves by ``lr_bump``: up when
the direction's sign is the same as at the previous step (the element keeps going one way: a bigger step is
safe), down when it flipped (it overshot), clamped to [``min_lr``, ``max_lr``]; it starts at ``lr``. The first
step only records signs. Decoupled weight decay is scaled by the same per-element rate. The scheduler's
``lr`` is not read after the start: the per-element rates are the schedule (``avg_lr`` reports their mean).

Kahan summation (diffusion-pipe's addition to the ai-toolkit class) keeps 16-bit weights from losing updates
far below their precision: the float32 result is rounded into the weight and what rounding lost is kept in
``shift`` and added back next step, as ``optim/kahan.py`` does for AdamW8bit.

State per element: the learning rate (float32), the previous sign (bool) and the second-moment statistics;
all of it survives ``state_dict`` / ``load_state_dict`` at its own dtype (torch would otherwise cast float
state to a 16-bit weight's dtype, which cannot hold a 1e-6 bump on a 1e-4 rate).
"""
from __future__ import annotations

import torch

COMPENSATED = (torch.bfloat16, torch.float16)


def _rms(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.square().mean().sqrt()


class Automagic(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-6, min_lr: float = 1e-7, max_lr: float = 1e-3, lr_bump: float = 1e-6,
                 eps=(1e-30, 1e-3), clip_threshold: float = 1.0, beta2: float = 0.999, weight_decay: float = 0.0):
        if not 0 < min_lr <= max_lr:
            raise ValueError(f"Automagic needs 0 < min_lr <= max_lr (got min_lr={min_lr}, max_lr={max_lr})")
        if not 0 <= beta2 < 1:
            raise ValueError(f"Automagic needs 0 <= beta2 < 1 (got {beta2})")
        if lr_bump < 0 or clip_threshold <= 0 or weight_decay < 0:
            raise ValueError("Automagic needs lr_bump >= 0, clip_threshold > 0 and weight_decay >= 0")
        defaults = dict(lr=lr, min_lr=min_lr, max_lr=max_lr, lr_bump=lr_bump, eps=eps,
                        clip_threshold=clip_threshold, beta2=beta2, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        state["step"] = 0
        start = min(max(group["lr"], group["min_lr"]), group["max_lr"])
        state["lr_mask"] = torch.full(p.shape, start, dtype=torch.float32, device=p.device)
        state["last_polarity"] = torch.zeros(p.shape, dtype=torch.bool, device=p.device)
        if p.dim() >= 2:
            state["exp_avg_sq_row"] = torch.zeros(p.shape[:-1], dtype=torch.float32, device=p.device)
            state["exp_avg_sq_col"] = torch.zeros(p.shape[:-2] + p.shape[-1:], dtype=torch.float32, device=p.device)
        else:
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if p.dtype in COMPENSATED:
            state["shift"] = torch.zeros_like(p)
        return state

    @staticmethod
    def _direction(grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        """Adafactor's step direction for ``grad`` (float32), its statistics updated in ``state``."""
        eps = group["eps"][0] if isinstance(group["eps"], (tuple, list)) else group["eps"]
        beta2 = group["beta2"]
        squared = grad.square().add_(eps)
        if "exp_avg_sq_row" in state:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            row.mul_(beta2).add_(squared.mean(dim=-1), alpha=1 - beta2)
            col.mul_(beta2).add_(squared.mean(dim=-2), alpha=1 - beta2)
            # the rank-1 estimate of the full running mean: row x col / mean(row)
            row_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1)
            direction = row_factor * col.unsqueeze(-2).rsqrt() * grad
        else:
            state["exp_avg_sq"].mul_(beta2).add_(squared, alpha=1 - beta2)
            direction = state["exp_avg_sq"].rsqrt() * grad
        return direction.div_((_rms(direction) / group["clip_threshold"]).clamp_(min=1.0))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Automagic does not take sparse gradients")
                state = self.state[p] if self.state[p] else self._init_state(p, group)
                state["step"] += 1
                direction = self._direction(p.grad.float(), state, group)
                polarity = direction > 0
                lr = state["lr_mask"]
                if state["step"] > 1:   # the first step has no previous sign to compare with
                    agree = polarity == state["last_polarity"]
                    lr.add_(torch.where(agree, group["lr_bump"], -group["lr_bump"]))
                    lr.clamp_(group["min_lr"], group["max_lr"])
                state["last_polarity"] = polarity
                shift = state.get("shift")
                work = p.float() if shift is None else p.float().add_(shift)
                if group["weight_decay"]:
                    work.sub_(work * lr * group["weight_decay"])
                work.sub_(direction.mul_(lr))
                p.copy_(work)                                  # rounded to a 16-bit weight's dtype
                if shift is not None:
                    shift.copy_(work.sub_(p.float()))          # what rounding lost, added back next step
        return loss

    def avg_lr(self) -> float | None:
        """The mean per-element learning rate over every stepped parameter (diffusion-pipe logs it as
        ``train/automagic_avg_lr``); None before the first step."""
        masks = [s["lr_mask"] for s in self.state.values() if "lr_mask" in s]
        if not masks:
            return None
        return float(sum(m.sum() for m in masks) / sum(m.numel() for m in masks))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading, then each saved tensor back at its saved dtype (torch casts float state to the
        parameter's dtype: a bfloat16 weight would get a bfloat16 learning-rate mask)."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for index, p in zip(ids, params):
            for key, value in state_dict["state"].get(index, {}).items():
                if torch.is_tensor(value) and key != "step":
                    self.state[p][key] = value.to(p.device, copy=True)
