"""Attention for training: torch SDPA (which has a backward on every device), fed by ComfyUI's RoPE."""
import torch
from torch.nn import functional as F


def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pe: torch.Tensor | None) -> torch.Tensor:
    """q, k, v [B, H, L, D] -> [B, L, H*D], rotary embedding applied with ComfyUI's ``apply_rope``."""
    from comfy.ldm.flux.math import apply_rope

    if pe is not None:
        q, k = apply_rope(q, k, pe)
    out = F.scaled_dot_product_attention(q, k, v)
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)
