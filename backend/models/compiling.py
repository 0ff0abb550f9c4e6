"""``compile = true``: regional torch.compile of the transformer blocks.

Every block layer's ``block_forward`` (the part that calls ComfyUI's block: attention, MLP, modulation, LoRA
hooks) is compiled; the pipeline plumbing around it (bit-cast carries, checkpointing) stays eager. Blocks of
one kind share their code, so TorchDynamo compiles each kind once and reuses the graph for every block
(parameters are graph inputs). A new bucket shape triggers one more compile with dynamic sequence lengths
(Dynamo's automatic dynamic shapes), not one per bucket.
"""
from __future__ import annotations

# one cache entry per block kind and shape regime; generous so no block silently falls back to eager
CACHE_SIZE_LIMIT = 64


def compile_blocks(layers) -> int:
    """Compile the ``block_forward`` of every layer that has one; returns how many were wrapped."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, CACHE_SIZE_LIMIT)
    count = 0
    for layer in layers:
        forward = getattr(layer, "block_forward", None)
        if forward is None:
            continue
        layer.block_forward = torch.compile(forward)   # an instance attribute shadows the method
        count += 1
    return count
