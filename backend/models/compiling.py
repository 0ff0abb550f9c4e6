"""``compile = true``: regional torch.compile of the transformer blocks.

The adapter chooses the region (``ModelAdapter.compile``). By default every block layer's ``block_forward`` (the
part that calls ComfyUI's block: attention, MLP, modulation, LoRA hooks) is compiled (``compile_blocks``); the
pipeline plumbing around it (bit-cast carries) stays eager. A block under torch's activation checkpointing is
compiled with its checkpoint inside the graph, so AOTAutograd plans the recompute (it fuses the recomputed forward
into the backward and keeps what is cheaper to keep than to redo; RNG ops replay the forward's draws); 'unsloth'
checkpointing (its own autograd function) stays around the compiled block. Blocks of one kind share their code, so
TorchDynamo compiles each kind once and reuses the graph for every block (parameters are graph inputs). A new
bucket shape triggers one more compile with dynamic sequence lengths (Dynamo's automatic dynamic shapes), not one
per bucket.

A layer that is more than a transformer block (SDXL's UNet blocks: ResBlocks, convolutions, resampling around
the transformers) compiles the transformer modules inside it instead (``compile_module_forwards``); the rest and
the layer's checkpoint stay eager around them.

A region can also be replayed as CUDA graphs (torch.compile's ``reduce-overhead``): one launch instead of the
host issuing each kernel, for models whose steps are many small kernels (SDXL: launching its 70 transformer
blocks' kernels took the host longer than the GPU took to run them). Only where nothing moves a weight or
re-runs a forward inside the backward (``cuda_graphs_allowed``): a graph replays fixed addresses.

``activation_memory_budget`` (below 1) hands the recompute choice to AOTAutograd's partitioner instead of whole
blocks: each compiled graph keeps at most that share of the activations it would otherwise save for the backward,
and recomputes the rest, the ops that are cheapest to redo per byte first (norms, activations, modulation) before
any matrix product or attention.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from .checkpointing import checkpoint_options, runs_torch_checkpoint

# one cache entry per block kind and shape regime (static-shape models: per block shape and bucket);
# generous so no block silently falls back to eager
CACHE_SIZE_LIMIT = 128


def compile_blocks(layers, checkpoint_inside: bool = True, dynamic: bool | None = None,
                   memory_budget: float | None = None) -> int:
    """Compile the ``block_forward`` of every layer that has one; returns how many were wrapped.
    ``checkpoint_inside=False`` leaves the layer's own checkpoint eager around the compiled block (for
    comparison); ``dynamic`` is torch.compile's (the adapter's ``compile_dynamic``); ``memory_budget`` the config's
    ``activation_memory_budget``."""
    _raise_cache_size_limit()
    count = 0
    for layer in layers:
        forward = getattr(layer, "block_forward", None)
        if forward is None:
            continue
        mode = getattr(layer, "checkpoint_activations", False)
        if checkpoint_inside and runs_torch_checkpoint(mode):
            compiled = functools.partial(_compiled_checkpointed_block(dynamic, mode), layer)
            layer.checkpoint_activations = False       # the compiled forward checkpoints itself
        else:
            compiled = torch.compile(forward, dynamic=dynamic)
        layer.block_forward = within_budget(compiled, memory_budget)   # an instance attribute shadows the method
        count += 1
    return count


def within_budget(compiled, memory_budget: float | None):
    """``compiled`` run with AOTAutograd's activation memory budget: the partitioner reads it when a call compiles
    (the first, and a new shape's), so it is set around every call rather than for the whole process."""
    if memory_budget is None or memory_budget >= 1:
        return compiled
    from torch._functorch import config as functorch_config

    def run(*args, **kwargs):
        with functorch_config.patch(activation_memory_budget=memory_budget):
            return compiled(*args, **kwargs)
    return run


def _raise_cache_size_limit():
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, CACHE_SIZE_LIMIT)


@functools.cache
def _compiled_checkpointed_block(dynamic: bool | None, mode):
    # one compiled function for every layer: the layer is an argument, so blocks of a kind share a graph
    options = checkpoint_options(mode)

    def checkpointed_block(layer, *args):
        return checkpoint(type(layer).block_forward, layer, *args, use_reentrant=False, **options)
    return torch.compile(checkpointed_block, dynamic=dynamic)


def cuda_graphs_allowed(cfg) -> bool:
    """CUDA graphs for a run (``compile_cuda_graphs``, on by default): on a GPU, one pipeline stage (a stage of
    several runs forwards of later micro-batches before earlier backwards), no block swapping (it moves weights)
    and no activation checkpointing (its recompute runs forwards inside the backward)."""
    return (cfg.compile_cuda_graphs and torch.cuda.is_available() and cfg.pipeline_stages == 1
            and not cfg.blocks_to_swap and not cfg.activation_checkpointing)


def compile_module_forwards(modules, dynamic: bool | None = None, memory_budget: float | None = None,
                            cuda_graphs: bool = False) -> int:
    """Compile the ``forward`` of every module in ``modules`` (an instance attribute shadows the method); returns
    how many. One compiled function serves them all, the module an argument, so modules of one class and structure
    share a graph."""
    _raise_cache_size_limit()
    compiled = _compiled_module_forward(dynamic, "reduce-overhead" if cuda_graphs else None)
    count = 0
    for module in modules:
        module.forward = within_budget(functools.partial(compiled, module), memory_budget)
        count += 1
    return count


def _module_forward(module, *args, **kwargs):
    return type(module).forward(module, *args, **kwargs)


@functools.cache
def _compiled_module_forward(dynamic: bool | None, mode: str | None = None):
    return torch.compile(_module_forward, dynamic=dynamic, mode=mode)
