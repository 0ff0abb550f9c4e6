"""LoHa (LyCORIS' low-rank Hadamard product), ``[adapter] type = 'loha'``.

The update of a ``Linear`` is ``scale * (w1_a @ w1_b) * (w2_a @ w2_b)`` (element-wise product of two rank-r
matrices), ``scale = alpha / rank``. Saved as ComfyUI's ``comfy/weight_adapter/loha.py`` reads it: ``hada_w1_a``
[out, r], ``hada_w1_b`` [r, in], ``hada_w2_a`` [out, r], ``hada_w2_b`` [r, in] and ``alpha``. Initialised as
LyCORIS does (``hada_w2_a`` zero, so the layer starts unchanged). The forward never forms the [out, in] update:
a Hadamard product of two rank-r products is one rank-r² product, ``U @ V`` with ``U`` the row-wise Kronecker
product of the ``a`` factors and ``V`` the column-wise one of the ``b`` factors.
"""
from __future__ import annotations

import torch
from torch import nn

from .base import AddedModuleKind, copy_parts, normal_

PARTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")


class LoHa(nn.Module):
    def __init__(self, in_features: int, out_features: int, spec, generator: torch.Generator, device=None):
        super().__init__()
        kw = dict(device=device, dtype=spec.dtype)
        self.hada_w1_a = nn.Parameter(torch.empty(out_features, spec.rank, **kw))
        self.hada_w1_b = nn.Parameter(torch.empty(spec.rank, in_features, **kw))
        self.hada_w2_a = nn.Parameter(torch.zeros(out_features, spec.rank, **kw))
        self.hada_w2_b = nn.Parameter(torch.empty(spec.rank, in_features, **kw))
        normal_(self.hada_w1_a, generator, 0.1)
        normal_(self.hada_w1_b, generator, 1.0)
        normal_(self.hada_w2_b, generator, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``((w1_a @ w1_b) * (w2_a @ w2_b)) @ x`` (unscaled)."""
        w1a, w1b, w2a, w2b = (getattr(self, p).to(x.dtype) for p in PARTS)
        u = (w1a.unsqueeze(2) * w2a.unsqueeze(1)).flatten(1)      # [out, r*r]
        v = (w1b.unsqueeze(1) * w2b.unsqueeze(0)).flatten(0, 1)   # [r*r, in]
        return nn.functional.linear(nn.functional.linear(x, v), u)

    def delta_weight(self) -> torch.Tensor:
        """The [out, in] update (unscaled), for checks."""
        return (self.hada_w1_a @ self.hada_w1_b) * (self.hada_w2_a @ self.hada_w2_b)

    def saved_tensors(self, scale: float, alpha: float) -> dict[str, torch.Tensor]:
        return {**{p: getattr(self, p) for p in PARTS}, "alpha": torch.tensor(float(alpha))}

    def load(self, sd: dict[str, torch.Tensor], key: str, scale: float) -> int:
        if f"{key}.hada_w1_a" not in sd:
            return 0
        copy_parts(self, PARTS, sd, key)
        return 1


class LoHaKind(AddedModuleKind):
    name = "loha"
    marker = "hada_w1_a"
    attribute = "loha"
    module = LoHa
