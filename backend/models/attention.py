"""Attention for training: torch SDPA (which has a backward on every device), fed by ComfyUI's RoPE.

Captions of different lengths in one micro-batch are zero-padded to the longest; where the text tokens
take part in self-attention (joint attention of SD3, Flux-style double and single blocks of Chroma), the
padding is masked out as keys, so every sample's output equals its output alone, which is what ComfyUI
computes (it never batches conditionings of different lengths there).
"""
import torch
from torch.nn import functional as F


def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pe: torch.Tensor | None,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """q, k, v [B, H, L, D] -> [B, L, H*D], rotary embedding applied with ComfyUI's ``apply_rope``;
    ``mask`` a boolean key mask [B, 1, 1, L] (True: attend) or None."""
    from comfy.ldm.flux.math import apply_rope

    if pe is not None:
        q, k = apply_rope(q, k, pe)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)


def text_key_mask(text_lengths: torch.Tensor | None, text_len: int, other_len: int, text_first: bool = True):
    """Boolean key mask [B, 1, 1, text_len + other_len] that hides the zero padding after each sample's
    ``text_lengths[b]`` text tokens; None when no sample is padded."""
    if text_lengths is None or bool((text_lengths >= text_len).all()):
        return None
    text = torch.arange(text_len, device=text_lengths.device)[None] < text_lengths[:, None]
    other = torch.ones(text.shape[0], other_len, dtype=torch.bool, device=text.device)
    keys = torch.cat((text, other) if text_first else (other, text), dim=1)
    return keys[:, None, None, :]


def _comfy_sdpa(func, *args, **kwargs):
    """An ``optimized_attention_override``: whatever backend ComfyUI picked, run its SDPA path instead."""
    from comfy.ldm.modules.attention import attention_pytorch

    return attention_pytorch(*args, **kwargs)


def sdpa_transformer_options(key_mask: torch.Tensor | None = None) -> dict:
    """``transformer_options`` that route ComfyUI's ``optimized_attention`` calls to torch SDPA.

    ComfyUI picks one attention function at import (sub-quadratic on the CPU; xformers, sage or flash when
    installed; sage and some flash builds have no backward). Its ``wrap_attn`` seam lets a caller override
    that choice per call, so training runs ComfyUI's own ``attention_pytorch`` without patching anything.
    ``key_mask`` (see ``text_key_mask``) is applied to the calls whose keys it fits (a block may also attend
    over the image tokens alone, as SD3.5's second attention does). A fresh dict each call: ComfyUI's blocks
    write bookkeeping keys into it.
    """
    if key_mask is None:
        return {"optimized_attention_override": _comfy_sdpa}

    def masked(func, q, k, v, *args, **kwargs):
        keys = k.shape[2] if kwargs.get("skip_reshape") else k.shape[1]
        if keys == key_mask.shape[-1]:
            if len(args) >= 2:           # attention(q, k, v, heads, mask, ...): the mask given by position
                if args[1] is None:
                    args = (args[0], key_mask, *args[2:])
            elif kwargs.get("mask") is None:
                kwargs["mask"] = key_mask
        return _comfy_sdpa(func, q, k, v, *args, **kwargs)
    return {"optimized_attention_override": masked}
