# SPDX-License-Identifier: GPL-3.0-or-later
"""Every place PipeTrain replaces part of DeepSpeed, one named function each: what to audit on a DeepSpeed upgrade.

Each function first checks (``patching.require``) that what it replaces exists and takes the arguments the
replacement was written for; an upgrade that moved it stops with an error naming DeepSpeed's version and the
attribute. Tests: tests/ranks/test_patches.py.

- ``clear_trained_grads_only``: the engine's ``zero_grad`` (per engine).
- ``clip_gradients_with``: the engine's ``clip_fp32_gradients`` (per engine).
- ``skip_single_rank_allreduce``: the pipeline engine's gradient all-reduce over one data-parallel rank (per engine).
- ``partition_stages_with``: ``PipelineModule._partition_layers``, a private method (per module).
- ``skip_cpu_shm_build``: the C++ shared-memory all-reduce DeepSpeed compiles for CPU ranks (process-wide).
"""
from __future__ import annotations

import importlib
from typing import Callable

from . import patching

HOST = "DeepSpeed"


def _version() -> str:
    import deepspeed
    return deepspeed.__version__


def _require(owner, name: str, params: tuple[str, ...] | None = None):
    return patching.require(HOST, _version, owner, name, params)


def clear_trained_grads_only(engine, params: list) -> None:
    """DeepSpeed clears gradients after every step by walking ``module.named_parameters()``, every frozen base
    weight too; only the trained ``params`` hold any. For SDXL batch 8 on an H200, where the host paces the step,
    clearing only those took 14.9 to 17.6 samples/s."""
    _require(type(engine), "zero_grad", ("self",))

    def zero_grad():
        for p in params:
            p.grad = None
    engine.zero_grad = zero_grad


def clip_gradients_with(engine, clip: Callable[[], None]) -> None:
    """``clip()`` runs where DeepSpeed clips the gradients before the optimizer step (``gradient_clipping`` > 0)."""
    _require(type(engine), "clip_fp32_gradients", ("self",))
    engine.clip_fp32_gradients = clip


def skip_single_rank_allreduce(engine) -> None:
    """With one data-parallel rank DeepSpeed still flattens every gradient into a bucket, all-reduces it over that
    one rank and copies it back; the pipeline engine's own switch turns that off."""
    _require(engine, "pipeline_enable_backward_allreduce")
    engine.pipeline_enable_backward_allreduce = False


def partition_stages_with(module, parts: Callable[[int, int], list[int]]) -> None:
    """Before ``PipelineModule.__init__`` (which partitions): ``module``'s stages are cut at ``parts(layers,
    stages)`` (the boundaries, first 0, last the layer count) in place of DeepSpeed's methods."""
    from deepspeed.pipe import PipelineModule
    _require(PipelineModule, "_partition_layers", ("self", "method"))
    _require(PipelineModule, "_set_bounds", ("self", "start", "stop"))

    def _partition_layers(method="uniform"):
        module.parts = parts(len(module._layer_specs), module.num_stages)
        stage = module._topo.get_coord(module.global_rank).pipe
        module._set_bounds(start=module.parts[stage], stop=module.parts[stage + 1])
    object.__setattr__(module, "_partition_layers", _partition_layers)   # before nn.Module's own __init__


def skip_cpu_shm_build() -> None:
    """DeepSpeed JIT-compiles a C++ shared-memory all-reduce for CPU ranks at start-up (minutes on 2 cores, and
    again for every other interpreter path); gloo's all-reduce is all CPU ranks need. Before ``init_distributed``."""
    comm = importlib.import_module("deepspeed.comm.torch")
    _require(comm, "build_shm_op", ())
    comm.build_shm_op = lambda: None
