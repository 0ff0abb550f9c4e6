"""OFT (orthogonal fine-tuning, LyCORIS' diagonal variant), ``[adapter] type = 'oft'``.

The weight's output rows are rotated block by block: ``W' = R^T W`` with ``R`` block-diagonal, each block the
Cayley transform ``(I + Q)(I - Q)^-1`` of a skew-symmetric ``Q = B - B^T``. ``B``, saved as ``oft_blocks``
[blocks, size, size], starts at zero (``R = I``). ``rank`` bounds the block size as in ComfyUI's
``OFTAdapter.create_train`` (``factorization(out, rank)``); ``alpha`` is the constraint, as ComfyUI reads it:
above 0, ``Q`` is scaled down to a Frobenius norm of at most ``alpha`` (saved as ``alpha``; 0: unconstrained,
the default). Saved keys are those ``comfy/weight_adapter/oft.py`` loads. The bias is not rotated, so the
forward rotates the base output less its bias. There is no input for ``dropout`` to act on.
"""
from __future__ import annotations

import torch
from torch import nn

from .base import AdapterKind, copy_parts
from .lokr import factorization


class OFT(nn.Module):
    def __init__(self, out_features: int, spec, device=None):
        super().__init__()
        size, count = factorization(out_features, spec.rank)
        self.oft_blocks = nn.Parameter(torch.zeros(count, size, size, device=device, dtype=spec.dtype))
        self.constraint = float(spec.alpha)

    def rotation(self) -> torch.Tensor:
        """The blocks of ``R`` [blocks, size, size], float32, as ComfyUI computes them."""
        blocks = self.oft_blocks.float()
        q = blocks - blocks.transpose(1, 2)
        if self.constraint > 0:
            norm = torch.norm(q) + 1e-8
            q = torch.where(norm > self.constraint, q * (self.constraint / norm), q)
        eye = torch.eye(q.shape[-1], device=q.device, dtype=q.dtype)
        return (eye + q) @ torch.linalg.inv(eye - q)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` (the base product without bias) with its output features rotated: ``h @ R``."""
        r = self.rotation().to(h.dtype)
        blocks = h.unflatten(-1, (r.shape[0], r.shape[1]))
        return torch.einsum("...kn,knm->...km", blocks, r).flatten(-2)


class OFTKind(AdapterKind):
    name = "oft"
    marker = "oft_blocks"

    def default_alpha(self, rank: int) -> float:
        return 0.0

    def attach(self, linear, spec, generator):
        linear.oft = OFT(linear.out_features, spec, linear.weight.device)

    def forward(self, linear, x, output):
        if linear.bias is None:
            return linear.oft(output)
        bias = linear.bias.to(output)
        return linear.oft(output - bias) + bias

    def parameters(self, linear):
        return [linear.oft.oft_blocks]

    def saved(self, linear):
        return {"oft_blocks": linear.oft.oft_blocks, "alpha": torch.tensor(linear.oft.constraint)}

    def load(self, linear, sd, key):
        if f"{key}.oft_blocks" not in sd:
            return 0
        copy_parts(linear.oft, ("oft_blocks",), sd, key)
        return 1
