"""The DeepSpeed ``PipelineModule`` over an adapter's layers, with compute-balanced partitioning.

``parameters`` balances parameter counts, every parameter counted, frozen or not (diffusion-pipe's meaning:
DeepSpeed's own method counts trainable ones only, which for a LoRA are a sliver of each layer); Flux's double
blocks hold 2.4x the parameters of a single block at the same per-token cost, so it splits badly. ``compute``
balances the adapter's per-layer cost estimates instead; ``manual`` takes layer indices from the config.
"""
from __future__ import annotations

import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime import utils as ds_utils

from .patches_deepspeed import partition_stages_with


class StagedModule(PipelineModule):
    def __init__(self, layers, costs: list[float], num_stages: int, method: str, split: list[int] | None,
                 loss_fn):
        if method in ("compute", "parameters", "manual"):
            bounds = partition_bounds(method, layers, costs, num_stages, split)
            partition_stages_with(self, lambda n, stages: bounds)
        super().__init__(layers=layers, num_stages=num_stages, loss_fn=loss_fn, dynamic_shape=True,
                         partition_method=method if method == "uniform" else "uniform",
                         activation_checkpoint_interval=0)

    def forward(self, forward_input):
        out = super().forward(forward_input)
        if self.stage_id == self.num_stages - 1:
            return out
        return tuple(map(sendable, out)) if isinstance(out, tuple) else sendable(out)


def sendable(t):
    """DeepSpeed receives into row-major buffers of the sent shape, and torch.distributed sends a channels-last
    tensor's bytes as they lie: the next stage would read them scrambled. Integers carried on the host
    (``models.carry.sizes``) go to the GPU, which NCCL sends from."""
    if not torch.is_tensor(t):
        return t
    if t.device.type == "cpu" and torch.cuda.is_available():
        t = t.to(torch.cuda.current_device())
    return t.contiguous()


def partition_bounds(method: str, layers, costs: list[float], num_stages: int, split: list[int] | None) -> list[int]:
    """The layer boundaries of each stage (first 0, last the layer count) for ``compute``, ``parameters`` and
    ``manual`` partitioning."""
    if method == "compute":
        return stage_bounds(costs, num_stages)
    if method == "parameters":
        counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        return [int(b) for b in ds_utils.partition_balanced(weights=counts, num_parts=num_stages)]
    return [0, *split, len(layers)]


def stage_bounds(costs: list[float], num_stages: int) -> list[int]:
    """The layer boundaries ``compute`` partitioning picks (for logging and tests)."""
    return [int(b) for b in ds_utils.partition_balanced(weights=[max(c, 1e-3) for c in costs], num_parts=num_stages)]
