"""Gradient clipping by the global 2-norm: DeepSpeed's ``clip_grad_norm_`` (runtime/utils.py, 0.19.8) with
foreach kernels. DeepSpeed launches a norm and a multiply per parameter, some two thousand tiny kernels a
step for a Flux LoRA; this launches one norm per device and dtype and one multiply per device for float32
gradients (the LoRA's; lower-precision ones are still multiplied one by one), and never waits on the device."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.utils import groups


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    grouped = defaultdict(list)
    for t in tensors:
        grouped[(t.device, t.dtype)].append(t)
    return list(grouped.values())


def _sum_of_squares(grads: list[torch.Tensor], device: str) -> torch.Tensor:
    sums = [torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32)).pow(2).sum().to(device)
            for group in _by_device_and_dtype(grads)]
    return torch.stack(sums).sum() if sums else torch.zeros((), device=device)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, mpu=None) -> torch.Tensor:
    """Scale the gradients in place so their global 2-norm is at most ``max_norm``; returns the norm before
    clipping, a tensor on the parameters' device."""
    params = [p for p in parameters if p.grad is not None]
    counted = params
    if mpu is not None:   # DeepSpeed's rule: a replicated parameter counts on model-parallel rank 0 only
        counted = [p for p in params if mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)]
    total = _sum_of_squares([p.grad for p in counted], get_accelerator().current_device_name())
    if mpu is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    total = total.pow(0.5)
    # DeepSpeed averages the norm over the data-parallel group (MoE parameters differ between its ranks)
    pg = groups._get_data_parallel_group()
    total = total / float(dist.get_world_size(group=pg))
    dist.all_reduce(total, group=pg)
    if not params:
        return total
    total = total.to(params[0].device)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grads in _by_device_and_dtype([p.grad for p in params]):
        scale = coef.to(grads[0].device)
        if grads[0].dtype == torch.float32:
            torch._foreach_mul_(grads, scale)
        else:
            # a foreach multiply rounds the coefficient to the gradients' dtype on CUDA; DeepSpeed multiplies in
            # float32 (its coefficient has shape [1], so it takes part in type promotion), and so does this
            for g in grads:
                g.mul_(scale.view(1))
    return total
