"""LoRA, optionally weight-decomposed (DoRA, ``[adapter] dora = true``).

LoRA: children ``lora_A`` / ``lora_B`` of the linear, saved as ``<module>.lora_A.weight`` / ``lora_B.weight``
(+ ``alpha``), the update ``scale * B @ A`` with ``scale = alpha / rank``.

DoRA adds a trainable magnitude ``dora_scale`` of shape [1, in] (one per input column), the layout whose
branch of ComfyUI's ``weight_decompose`` renormalises the *adapted* weight: the layer's weight becomes
``dora_scale * V / (||V||_col + eps)`` with ``V = W + scale * B @ A``. (A [out, 1] magnitude would take ComfyUI's
other branch, which divides by the norm of the base weight instead.) The forward never forms ``V``: its squared
column norms expand into the base's plus terms of size [in, rank], and ``V x`` with ``x`` scaled per column is
the base product plus the low-rank one.
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.fp8 import base_weight
from .base import AdapterKind, AdapterSpec, copy_parts, dropped, uniform_

# ComfyUI adds this to the column norms; its patcher computes in float32
NORM_EPS = torch.finfo(torch.float32).eps


def column_norms(linear: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """||W + scale * B @ A|| per input column, [1, in] float32, with gradients into A and B (``w``: W, float32)."""
    a, b, s = linear.lora_A.weight.float(), linear.lora_B.weight.float(), linear.lora_scale
    squared = (w * w).sum(0) + 2 * s * ((w.T @ b) * a.T).sum(1) + s * s * ((a.T @ (b.T @ b)) * a.T).sum(1)
    return squared.clamp(min=0).sqrt().unsqueeze(0)


class LoRA(AdapterKind):
    name = "lora"
    marker = "lora_A.weight"

    def attach(self, linear, spec: AdapterSpec, generator):
        device = linear.weight.device
        linear.lora_A = nn.Linear(linear.in_features, spec.rank, bias=False, device=device, dtype=spec.dtype)
        linear.lora_B = nn.Linear(spec.rank, linear.out_features, bias=False, device=device, dtype=spec.dtype)
        uniform_(linear.lora_A.weight, generator)
        nn.init.zeros_(linear.lora_B.weight)
        if spec.dora:   # starts at the base weight's own norms: the layer is unchanged until B moves
            norms = base_weight(linear).norm(dim=0, keepdim=True) + NORM_EPS
            linear.dora_scale = nn.Parameter(norms.to(device=device, dtype=spec.dtype))

    def forward(self, linear, x, output):
        a = linear.lora_A.weight.to(x.dtype)
        b = linear.lora_B.weight.to(x.dtype)
        magnitude = getattr(linear, "dora_scale", None)
        if magnitude is None:
            return output + nn.functional.linear(nn.functional.linear(dropped(linear, x), a), b) * linear.lora_scale
        weight = base_weight(linear)   # an fp8-stored weight times its scale, as ComfyUI patches it
        gain = (magnitude.float() / (column_norms(linear, weight) + NORM_EPS)).to(x.dtype)   # [1, in]
        weight = weight.to(x)
        bias = linear.bias.to(x) if linear.bias is not None else None
        low_rank = nn.functional.linear(nn.functional.linear(dropped(linear, x) * gain, a), b)
        return nn.functional.linear(x * gain, weight, bias) + low_rank * linear.lora_scale

    def parameters(self, linear):
        extra = [linear.dora_scale] if hasattr(linear, "dora_scale") else []
        return [linear.lora_A.weight, linear.lora_B.weight, *extra]

    def saved(self, linear):
        parts = {f"{p}.weight": getattr(linear, p).weight for p in ("lora_A", "lora_B")}
        parts["alpha"] = torch.tensor(float(linear.lora_alpha))
        if hasattr(linear, "dora_scale"):
            parts["dora_scale"] = linear.dora_scale
        return parts

    def load(self, linear, sd, key):
        if f"{key}.lora_A.weight" not in sd:
            return 0
        copy_parts(linear.lora_A, ("weight",), sd, f"{key}.lora_A")
        copy_parts(linear.lora_B, ("weight",), sd, f"{key}.lora_B")
        if hasattr(linear, "dora_scale"):
            if f"{key}.dora_scale" not in sd:
                raise ValueError(f"{key}: a LoRA without dora_scale, this run trains DoRA (set dora = false)")
            copy_parts(linear, ("dora_scale",), sd, key)
        return 1
