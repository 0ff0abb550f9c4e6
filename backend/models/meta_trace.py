# SPDX-License-Identifier: GPL-3.0-or-later
"""What each pipeline layer of a model keeps in GPU memory, found without a GPU and without memory.

The model is ComfyUI's own class built on the ``meta`` device (shapes, no storage) and run forward through the
adapter's layers at the run's latent size, batch and caption length. Autograd's saved-tensor hooks report every
tensor a layer keeps for its backward; those bytes, the layer's weights and the tensors it hands to the next
layer are the footprint ``backend/memory/plan.py`` adds up for each checkpointing and swapping choice.

Two things would make a plain meta forward wrong or impossible:
- SDPA has no meta kernel of its own: on ``meta`` it falls back to the math path, which keeps the whole score
  matrix (tokens² per head), while the GPU kernels training runs keep the output and one float per query row;
  during the trace attention is a stand-in that keeps exactly that.
- Model code reads small values back (a grid size, caption lengths): small tensors are made and computed on the
  CPU for real, and join ``meta`` only when they meet a large tensor.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

SMALL = 1 << 16          # elements: values made on the device up to this size are computed for real on the CPU
SMALL_INPUT = 1 << 12    # elements: inputs up to this size (timesteps, caption lengths) stay real
_FACTORIES = {torch.tensor, torch.as_tensor, torch.arange, torch.linspace, torch.full, torch.zeros, torch.ones}


@dataclass(frozen=True)
class LayerFootprint:
    """One pipeline layer at one input size, in bytes."""
    name: str
    weights: int           # frozen parameters (the base model's)
    linear_weights: int    # of which the weights of linear layers (what fp8 storage halves)
    trainable: int         # trainable parameter count (adapter, or everything in a full fine-tune)
    saved: int             # tensors kept for the backward when the layer is not checkpointed
    output: int            # tensors handed to the next layer
    checkpointable: bool   # a transformer block (CheckpointedLayer): checkpointing and swapping apply


class _AttentionStandIn(torch.autograd.Function):
    """Keeps what the GPU's flash/cuDNN kernels keep: q, k, v, the output and a float32 log-sum-exp per row."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _AttentionStandIn.apply(q, k, v)


class _SmallFactoriesOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and str(kwargs.get("device", "")) == "meta":
            out = func(*args, **{**kwargs, "device": "cpu"})
            return out if out.numel() <= SMALL else out.to("meta")
        return func(*args, **kwargs)


class _MetaWhereMixed(TorchDispatchMode):
    """An op that meets a meta tensor runs on meta, its CPU operands moved there (no device mismatch)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if any(torch.is_tensor(t) and t.device.type == "meta" for t in flat):
            def to_meta(t):
                return t.to("meta") if torch.is_tensor(t) and t.device.type != "meta" else t
            args, kwargs = tree_map(to_meta, args), tree_map(to_meta, kwargs)
            if "device" in kwargs:            # a copy of a meta tensor to the CPU stays on meta
                kwargs["device"] = torch.device("meta")
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_forward():
    """The context a trace runs in: attention stand-in, small values real, everything else meta."""
    import torch.fx.experimental._config as fx_config

    real_sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _attention
    try:
        # mixture-of-experts routing (HiDream) asks which tokens go where: on meta, every token to each expert
        # it could take, an upper bound
        with _SmallFactoriesOnCpu(), _MetaWhereMixed(), fx_config.patch(meta_nonzero_assume_all_nonzero=True):
            yield
    finally:
        F.scaled_dot_product_attention = real_sdpa


def to_meta_where_large(inputs: tuple) -> tuple:
    return tuple(x.to("meta") if torch.is_tensor(x) and x.numel() > SMALL_INPUT else x for x in inputs)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _weights(layer: torch.nn.Module) -> tuple[int, int, int]:
    frozen = sum(_nbytes(p) for p in layer.parameters() if not p.requires_grad)
    linear = sum(_nbytes(m.weight) for m in layer.modules()
                 if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad)
    trainable = sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return frozen, linear, trainable


def trace_layers(layers: list[torch.nn.Module], inputs: tuple) -> list[LayerFootprint]:
    """Each layer's footprint, running ``inputs`` (meta where large) through ``layers`` in order. The layers'
    parameters must be on ``meta``; a tensor saved twice, or saved as a view of another, counts once, and the
    parameters a layer saves (its frozen weights) count as weights, not activations."""
    from .checkpointing import CheckpointedLayer

    params = {id(p) for layer in layers for p in layer.parameters()}
    footprints, h = [], inputs
    with meta_forward():
        for layer in layers:
            seen, kept, saved = set(), [], 0

            def pack(t):
                nonlocal saved
                base = t._base if t._base is not None else t
                if id(t) not in params and id(base) not in params and id(base) not in seen:
                    seen.add(id(base))
                    kept.append(base)       # alive until the layer is done: ids are not reused meanwhile
                    saved += _nbytes(base)
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                h = layer(h)
            outs = h if isinstance(h, (tuple, list)) else (h,)
            frozen, linear, trainable = _weights(layer)
            footprints.append(LayerFootprint(
                name=type(layer).__name__, weights=frozen, linear_weights=linear, trainable=trainable, saved=saved,
                output=sum(_nbytes(x) for x in outs if torch.is_tensor(x)),
                checkpointable=isinstance(layer, CheckpointedLayer)))
    return footprints


def probe_inputs(adapter, width: int, height: int, frames: int = 1, batch: int = 1, device="cpu") -> tuple:
    """A training micro-batch for ``adapter`` without a dataset: random latents of one ``width`` x ``height``
    image (video models: ``frames`` frames), the adapter's probe captions, timestep 0.6, repeated ``batch`` times
    (what the benchmarks train on, and what the memory plan traces before anything is cached)."""
    g = torch.Generator().manual_seed(1)
    shape = list(adapter.empty_latent(width, height).shape)
    if len(shape) == 5 and adapter.framerate is not None:
        shape[2] = 1 + (frames - 1) // adapter.frame_multiple
    x0 = torch.randn(shape, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    t = torch.tensor([0.6])
    # edit references and i2v conditioning are latent-shaped (or a stack of latents [B, N, ...]: several
    # references): they take the training latent's size
    probe, k = adapter.probe_latent(g, (8, 8)).shape, x0.ndim - 2
    text = [torch.randn(*x.shape[:-k], *(b if a == p else a for a, p, b in zip(x.shape[-k:], probe[2:], x0.shape[2:])),
                        generator=g) if x0.ndim >= 4 and x.ndim in (x0.ndim, x0.ndim + 1) else x
            for x in adapter.probe_text(g)]
    one = (x0, noise, t, *text)
    return tuple(x.repeat(batch, *(1,) * (x.ndim - 1)).to(device) for x in one)
