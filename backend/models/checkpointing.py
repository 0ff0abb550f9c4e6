"""Activation checkpointing for every architecture's block layers: one function, four modes.

``activation_checkpointing``: false (keep activations), true (keep each block's inputs, run the block without
autograd and recompute it in backward) or ``'unsloth'`` (diffusion-pipe's / Unsloth's variant:
the block's saved inputs wait in CPU memory, copied out and back with ``non_blocking`` copies, and the block
is recomputed from them in backward; on the CPU the "copy" keeps the tensor as it is) or ``'selective'`` (as true,
but the outputs of the ops that cost the most to redo per byte kept are kept: the attention kernels and the matrix
products whose inner dimension is at least four times their output width, the MLP down-projections. The recompute
then runs the projections, norms, activations and modulation, a little over half of a forward, for about one more
hidden-state-sized tensor per op kept). The recompute replays the forward's RNG state, so LoRA dropout draws the
same mask.

true and 'unsloth' run the forward under no_grad in an autograd Function and recompute in its backward, not through
torch's non-reentrant checkpoint, whose saved-tensor hooks are a Python call for every tensor each op saves, in the
forward and again in the recompute: on a model whose step the host paces (SDXL) that is most of the checkpoint's
cost (a tiny SDXL step on the CPU, where the host is all the time: 75 ms non-reentrant, 57 ms this way, 39 ms
without checkpointing). 'selective' needs torch's checkpoint (its policy is a dispatch mode), and so do blocks
compiled with their checkpoint inside the graph (compiling.py), where the hooks are traced away.

The mode is a run policy: adapters build their layers without it and ``apply_checkpointing`` sets it on every
``CheckpointedLayer`` once, after construction (the engine, benchmarks and tests all go through it).

``activation_checkpointing_fraction`` below 1 keeps checkpointing on that share of the blocks only, spread
evenly over the model (``thin_checkpointing``): a step costs about that share of one forward pass extra instead
of a whole one, and memory lands between the two ends. Pick the smallest fraction that fits.
"""
from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .carry import TupleLayer

UNSLOTH = "unsloth"
SELECTIVE = "selective"

# SDPA's backend kernels, as the checkpoint sees them below F.scaled_dot_product_attention
ATTENTION_OPS = tuple(getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable") if hasattr(torch.ops.aten, name))
# a product costs twice its inner dimension in FLOPs per output element: the MLP down-projections (inner dimension
# 4x the width) keep the most compute per byte; the other projections (inner dimension <= width) are recomputed
KEPT_PRODUCT_RATIO = 4


def _kept_product(op, args) -> bool:
    if op is torch.ops.aten.mm.default:
        a, b = args[0], args[1]
    elif op is torch.ops.aten.addmm.default:
        a, b = args[1], args[2]
    else:
        return False
    return a.shape[-1] >= KEPT_PRODUCT_RATIO * b.shape[-1]


def _selective(ctx, op, *args, **kwargs):
    keep = op in ATTENTION_OPS or _kept_product(op, args)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective)


def runs_torch_checkpoint(mode) -> bool:
    """The modes a compiled block can take inside its graph: torch's checkpoint, without or with a policy."""
    return mode is True or mode == SELECTIVE


def checkpoint_options(mode) -> dict:
    """torch's checkpoint keyword arguments for a mode that ``runs_torch_checkpoint``."""
    return {"context_fn": _selective_contexts} if mode == SELECTIVE else {}


def selective_advice(mode, compiled_inside: bool) -> str | None:
    """A warning for 'selective' where its policy runs eagerly (``compiled_inside``: the adapter compiles the
    checkpointed blocks with the policy in their graphs): then it is a Python call on every operation of the forward
    and of the recompute, which costs more than it saves where the host paces the step."""
    if mode != SELECTIVE or compiled_inside:
        return None
    return ("activation_checkpointing = 'selective' runs its policy in Python on every operation here (no compiled "
            "block holds it): where the host paces the step it is slower than true (SDXL 1024² on an H200: 4.5 "
            "samples/s at batch 8 against 9.1 with true). It pays where the GPU paces the step (Flux-dev compiled: "
            "2.15 against 1.93); otherwise set activation_checkpointing = true")


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t.detach()
    pin = device.type == "cpu" and t.device.type == "cuda"
    out = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
    return out.copy_(t.detach(), non_blocking=True)


class _RecomputedCheckpoint(torch.autograd.Function):
    """forward(run, park, grad_anchor, *args): ``run(*args)`` without keeping activations, recomputed in backward
    from its tensor args, kept where they are or, with ``park``, in CPU memory. ``grad_anchor`` requires grad, so
    the output does even when no input does (frozen embedders upstream): the adapters inside the block still get
    their gradients."""

    @staticmethod
    def forward(ctx, run, park, grad_anchor, *args):
        ctx.run = run
        ctx.devices = [a.device if torch.is_tensor(a) else None for a in args]
        ctx.needs_grad = [torch.is_tensor(a) and a.requires_grad for a in args]
        ctx.parked = [_to(a, torch.device("cpu") if park else a.device) if torch.is_tensor(a) else a for a in args]
        ctx.cuda = any(d is not None and d.type == "cuda" for d in ctx.devices)
        ctx.rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state() if ctx.cuda else None
        with torch.no_grad():
            out = run(*args)
        ctx.tuple_out = isinstance(out, tuple)
        return out

    @staticmethod
    def backward(ctx, *grads):
        args = []
        for a, device, needs in zip(ctx.parked, ctx.devices, ctx.needs_grad):
            if torch.is_tensor(a):
                a = _to(a, device).requires_grad_(needs)
            args.append(a)
        devices = [torch.cuda.current_device()] if ctx.cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.rng)
            if ctx.cuda:
                torch.cuda.set_rng_state(ctx.cuda_rng)
            with torch.enable_grad():
                out = ctx.run(*args)
        outs = out if ctx.tuple_out else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        # the inputs stay with the graph (freed with it): DeepSpeed's pipeline engine backpropagates a stage's tuple
        # outputs one at a time with retain_graph, which runs this backward once per output
        return (None, None, None) + tuple(a.grad if torch.is_tensor(a) and needs else None
                                          for a, needs in zip(args, ctx.needs_grad))


def run_checkpointed(mode, fn, *args):
    """``fn(*args)`` under the configured activation checkpointing (``mode``: False, True, 'unsloth' or
    'selective')."""
    if not mode or not torch.is_grad_enabled():
        return fn(*args)
    if mode is True or mode == UNSLOTH:
        anchor = torch.empty(0, requires_grad=True)
        return _RecomputedCheckpoint.apply(fn, mode == UNSLOTH, anchor, *args)
    return checkpoint(fn, *args, use_reentrant=False, **checkpoint_options(mode))


class CheckpointedLayer(TupleLayer):
    """A pipeline layer whose ``block_forward(*tensors)`` runs under the run's activation checkpointing. Layers are
    built without it; ``apply_checkpointing`` sets the mode on every such layer once the list is built."""
    checkpoint_activations: bool | str = False   # the mode: False, True, 'unsloth' or 'selective'

    def checkpointed(self, *args):
        return run_checkpointed(self.checkpoint_activations, self.block_forward, *args)

    def run(self, *args):
        return self.checkpointed(*args)


class BlockLayer(CheckpointedLayer):
    """One of ComfyUI's transformer blocks as a checkpointed pipeline layer (``block_forward`` calls it)."""
    cost = 1.0

    def __init__(self, block, dtype):
        super().__init__()
        self.block, self.dtype = block, dtype


def apply_checkpointing(layers, mode, fraction: float = 1.0) -> int:
    """The run's activation checkpointing, applied once to an adapter's freshly built layers: every
    ``CheckpointedLayer`` takes ``mode`` (False, True, 'unsloth' or 'selective'), then ``fraction`` below 1 leaves it
    on that share of them (``thin_checkpointing``). Returns how many layers checkpoint."""
    blocks = [layer for layer in layers if isinstance(layer, CheckpointedLayer)]
    for layer in blocks:
        layer.checkpoint_activations = mode
    return thin_checkpointing(blocks, fraction)


def keeps_checkpoint(i: int, fraction: float) -> bool:
    """Whether the i-th checkpointable block keeps checkpointing at ``fraction``: evenly spread, block i when
    ``floor((i + 1) * fraction)`` steps up (the memory plan counts with the same rule)."""
    return math.floor((i + 1) * fraction) > math.floor(i * fraction)


def thin_checkpointing(layers, fraction: float) -> int:
    """Leave checkpointing on ``fraction`` of the checkpointed layers (``keeps_checkpoint``); returns how many
    keep it."""
    blocks = [layer for layer in layers if getattr(layer, "checkpoint_activations", False)]
    kept = 0
    for i, layer in enumerate(blocks):
        if keeps_checkpoint(i, fraction):
            kept += 1
        else:
            layer.checkpoint_activations = False
    return kept
