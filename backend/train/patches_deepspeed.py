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
- ``load_checkpoints_weights_only``: the checkpoint engine's ``load``, which reads every file of a checkpoint
  (per engine).
"""
from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import Callable

from ..host import patching
from ..errors import CheckpointError

HOST = "DeepSpeed"


def _version() -> str:
    import deepspeed
    return deepspeed.__version__


def _require(owner, name: str, params: tuple[str, ...] | None = None):
    return patching.require(HOST, _version, owner, name, params)


def clear_trained_grads_only(engine, params: list) -> None:
    """DeepSpeed clears gradients after every step by walking ``module.named_parameters()``, every frozen base
    weight too; only the trained ``params`` hold any. Where the host paces the step (SDXL at batch 8 on a fast GPU)
    that walk shows in the step time (docs/benchmarks.md)."""
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


def load_checkpoints_weights_only(engine) -> None:
    """DeepSpeed reads every file of a checkpoint (layers, optimizer, schedule) through its checkpoint engine's
    ``load``, whose torch engine unpickles without restriction: a file planted in a run folder would run
    code on resume. Ours reads tensors and plain values only (torch's restricted unpickler); the state DeepSpeed
    writes for PipeTrain's engines (no ZeRO, no loss scaler) needs no other class. Before ``load_checkpoint``."""
    checkpoint_engine = engine.checkpoint_engine
    _require(type(checkpoint_engine), "load", ("self", "path", "map_location"))

    def load(path, map_location=None):
        return load_weights_only(Path(path), map_location)
    checkpoint_engine.load = load


def load_weights_only(path: Path, map_location=None):
    """A torch file holding tensors and plain values; ``CheckpointError`` naming the file for anything else (a
    pickle that would build other objects or call functions) or a file torch cannot read."""
    import torch
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:   # the restricted unpickler met a global it does not allow
        raise CheckpointError(f"{path} holds more than tensors and plain values and was not loaded (loading it "
                              "could run code): delete this checkpoint folder and resume from an earlier one, "
                              "or start the run again") from None
    except (RuntimeError, EOFError) as e:   # a cut or damaged zip archive
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}): delete this checkpoint folder and "
                              "resume from an earlier one") from None
