"""LoKr (LyCORIS' low-rank Kronecker product), the adapter diffusion-pipe trains with ``[adapter] type = 'lokr'``.

The update of a ``Linear`` with weight [out, in] is ``scale * kron(w1, w2)``: ``out = out_l * out_k`` and
``in = in_m * in_n`` are split by ``factorization``; ``w1`` is [out_l, in_m] (starts at zero) and ``w2``
[out_k, in_n], itself factored into ``w2_a @ w2_b`` (rank r) when r is below half its larger side, as PEFT's
LoKr does. The forward never forms the Kronecker product: ``kron(w1, w2) @ x == vec(w1 @ X @ w2^T)`` with
``X = x`` viewed as [in_m, in_n].

Saved keys are those ComfyUI's ``comfy/weight_adapter/lokr.py`` reads: ``lokr_w1``, ``lokr_w2`` or
``lokr_w2_a`` / ``lokr_w2_b``, and ``alpha``. ComfyUI scales by ``alpha / r`` only when a factor matrix
gives it r; with a full ``w2`` it applies no scale, so the scale is folded into the saved ``lokr_w1``.
"""
from __future__ import annotations

import torch
from torch import nn

from .base import AddedModuleKind, copy_parts, uniform_


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """``dimension = m * n`` with m <= n: m = ``factor`` when it divides evenly, else the divisor pair with the
    smallest sum whose smaller side is at most ``factor`` (-1: no limit, i.e. as square as possible)."""
    if factor > 0 and dimension % factor == 0 and dimension >= factor * factor:
        return factor, dimension // factor
    limit = dimension if factor < 0 else factor
    best = (1, dimension)
    for m in range(2, int(dimension ** 0.5) + 1):
        if m > limit:
            break
        if dimension % m == 0:
            best = (m, dimension // m)
    return best


class LoKr(nn.Module):
    def __init__(self, in_features: int, out_features: int, spec, generator: torch.Generator, device=None):
        super().__init__()
        out_l, out_k = factorization(out_features, spec.decompose_factor)
        in_m, in_n = factorization(in_features, spec.decompose_factor)
        self.shape = (out_l, out_k, in_m, in_n)
        self.rank = spec.rank
        kw = dict(device=device, dtype=spec.dtype)
        self.lokr_w1 = nn.Parameter(torch.zeros(out_l, in_m, **kw))
        self.factored = spec.rank < max(out_k, in_n) / 2
        if self.factored:
            self.lokr_w2_a = nn.Parameter(torch.empty(out_k, spec.rank, **kw))
            self.lokr_w2_b = nn.Parameter(torch.empty(spec.rank, in_n, **kw))
            uniform_(self.lokr_w2_a, generator)
            uniform_(self.lokr_w2_b, generator)
        else:
            self.lokr_w2 = nn.Parameter(torch.empty(out_k, in_n, **kw))
            uniform_(self.lokr_w2, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``kron(w1, w2) @ x`` (unscaled) without forming the product."""
        out_l, out_k, in_m, in_n = self.shape
        lead = x.shape[:-1]
        xs = x.reshape(*lead, in_m, in_n)
        if self.factored:
            t = (xs @ self.lokr_w2_b.to(x.dtype).T) @ self.lokr_w2_a.to(x.dtype).T
        else:
            t = xs @ self.lokr_w2.to(x.dtype).T
        return (self.lokr_w1.to(x.dtype) @ t).reshape(*lead, out_l * out_k)

    def delta_weight(self) -> torch.Tensor:
        """kron(w1, w2) [out, in] (unscaled), for checks."""
        w2 = self.lokr_w2_a @ self.lokr_w2_b if self.factored else self.lokr_w2
        return torch.kron(self.lokr_w1, w2)

    def saved_tensors(self, scale: float, alpha: float) -> dict[str, torch.Tensor]:
        if self.factored:
            return {"lokr_w1": self.lokr_w1, "lokr_w2_a": self.lokr_w2_a, "lokr_w2_b": self.lokr_w2_b,
                    "alpha": torch.tensor(float(alpha))}
        return {"lokr_w1": self.lokr_w1 * scale, "lokr_w2": self.lokr_w2}

    def load(self, sd: dict[str, torch.Tensor], key: str, scale: float) -> int:
        """Copy ``key``'s saved tensors in (1 when found, 0 when ``sd`` has none); a shape mismatch raises."""
        if f"{key}.lokr_w1" not in sd:
            return 0
        names = ("lokr_w1", "lokr_w2_a", "lokr_w2_b") if self.factored else ("lokr_w1", "lokr_w2")
        unscaled = (lambda name, v: v / scale if name == "lokr_w1" else v) if not self.factored else None
        copy_parts(self, names, sd, key, unscaled)
        return 1


class LoKrKind(AddedModuleKind):
    name = "lokr"
    marker = "lokr_w1"
    attribute = "lokr"
    module = LoKr
