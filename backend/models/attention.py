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


def _comfy_sdpa(func, *args, **kwargs):
    """An ``optimized_attention_override``: whatever backend ComfyUI picked, run its SDPA path instead."""
    from comfy.ldm.modules.attention import attention_pytorch

    return attention_pytorch(*args, **kwargs)


def sdpa_transformer_options() -> dict:
    """``transformer_options`` that route ComfyUI's ``CrossAttention`` (SD-family UNets) to torch SDPA.

    ComfyUI picks one attention function at import (sub-quadratic on the CPU; xformers, sage or flash when
    installed; sage and some flash builds have no backward). Its ``wrap_attn`` seam lets a caller override
    that choice per call, so training runs ComfyUI's own ``attention_pytorch`` without patching anything.
    A fresh dict each call: ComfyUI's blocks write bookkeeping keys into it.
    """
    return {"optimized_attention_override": _comfy_sdpa}
