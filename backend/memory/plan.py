# SPDX-License-Identifier: GPL-3.0-or-later
"""How much GPU memory a run needs on each pipeline stage, and ``memory = "auto"``: the fastest memory settings
that fit the GPU.

The figures come from the model itself (``models/meta_trace.py``: weights and the tensors each layer keeps, traced
on the meta device at the run's latent size) plus what training adds: the adapter's weights, gradients and
optimizer states, the micro-batches a pipeline stage holds in flight, and the backward's transient buffers.
Each setting changes one term:
- ``activation_checkpointing``: a checkpointed block keeps only its input, and one block at a time is recomputed;
  ``'selective'`` also keeps its attention and down-projection outputs; ``'unsloth'`` parks the inputs in CPU
  memory;
- ``activation_checkpointing_fraction``: the share of blocks that checkpoint (evenly spread, as the trainer does);
- ``blocks_to_swap``: the frozen weights of a stage's last that many blocks live in CPU memory, two at a time on
  the GPU.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Union

from ..models.meta_trace import LayerFootprint

GIB = 2 ** 30
# Candidates for "auto", fastest first (measured on Flux-dev: no checkpointing, then checkpointing part of the
# blocks, then every block with 'selective', with true, with 'unsloth'); swapping comes after all of them.
_CHECKPOINTING = [(False, 1.0), (True, 0.25), (True, 0.5), (True, 0.75), ("selective", 1.0), (True, 1.0),
                  ("unsloth", 1.0)]
HEADROOM = 0.92        # of the GPU's memory the plan fills: the allocator's fragmentation and the CUDA context
CONTEXT_BYTES = GIB    # what the CUDA context and the communication buffers take outside PyTorch's allocator


@dataclass(frozen=True)
class MemorySettings:
    """The settings ``memory = "auto"`` chooses (the run config's keys of the same names)."""
    activation_checkpointing: Union[bool, str] = False
    activation_checkpointing_fraction: float = 1.0
    blocks_to_swap: int = 0

    def describe(self) -> str:
        ckpt = self.activation_checkpointing
        if ckpt is False:
            text = "no activation checkpointing"
        else:
            mode = "true" if ckpt is True else repr(ckpt)
            share = "" if self.activation_checkpointing_fraction >= 1 else \
                f" on {self.activation_checkpointing_fraction:.0%} of the blocks"
            text = f"activation_checkpointing = {mode}{share}"
        return text + (f", blocks_to_swap = {self.blocks_to_swap}" if self.blocks_to_swap else "")


@dataclass(frozen=True)
class StageEstimate:
    """Peak bytes one pipeline stage allocates on its GPU (and what it parks in CPU memory)."""
    weights: int
    adapter: int          # trained weights, their gradients and optimizer states
    activations: int
    transient: int        # the backward's gradient buffers
    host: int = 0         # 'unsloth' inputs and swapped blocks, in CPU memory
    loading: int = 0      # before training, where that is more (fp8_compute converts the weights after loading)

    @property
    def training(self) -> int:
        return self.weights + self.adapter + self.activations + self.transient

    @property
    def gpu(self) -> int:
        return max(self.training, self.loading)


@dataclass(frozen=True)
class Training:
    """What the run trains, for the adapter's share: bytes per trained parameter (weight, gradient, optimizer
    states), the micro-batches per optimizer step, and the stage layout."""
    state_bytes_per_param: int = 16     # float32 adapter with AdamW: weight, gradient, two moments
    micro_batches: int = 1              # gradient_accumulation_steps
    stages: int = 1
    fp8_weights: bool = False           # diffusion_model_dtype float8: linear weights one byte each
    fp8_compute: bool = False           # bf16 weights loaded, then the linears' turned to e4m3 (models/fp8.py)
    can_swap: bool = True               # blocks_to_swap needs an adapter and no fp8_compute


# optimizers that keep a Kahan compensation buffer in the weight's own dtype for 16-bit weights (optim/kahan.py,
# optim/automagic.py)
KAHAN_OPTIMIZERS = ("adamw8bitkahan", "automagic")
AUTOMAGIC_STATE_BYTES = 5   # a float32 learning-rate mask and a bool polarity (its factored moments are per row)


def _state_bytes(optimizer: str) -> int:
    """An optimizer's own state per parameter: two moments of 1 or 4 bytes each, or automagic's mask and polarity."""
    name = optimizer.lower()
    if name == "automagic":
        return AUTOMAGIC_STATE_BYTES
    return 2 if "8bit" in name else 8


def state_bytes_per_param(adapter_dtype_bytes: int, optimizer: str, full_finetune: bool) -> int:
    """Weight + gradient + optimizer states per trained parameter. A full fine-tune keeps bf16 weights and
    gradients with a float32 master copy (DeepSpeed's bf16 optimizer)."""
    moments = _state_bytes(optimizer)
    if full_finetune:
        return 2 + 2 + 4 + moments
    shift = adapter_dtype_bytes if adapter_dtype_bytes == 2 and optimizer.lower() in KAHAN_OPTIMIZERS else 0
    return 2 * adapter_dtype_bytes + moments + shift


def checkpointed_flags(footprints: list[LayerFootprint], settings: MemorySettings) -> list[bool]:
    """Which layers checkpoint under ``settings``: the trainer's rule (``checkpointing.thin_checkpointing``)."""
    from ..models.checkpointing import keeps_checkpoint

    flags, i = [], 0
    for fp in footprints:
        on = False
        if fp.checkpointable and settings.activation_checkpointing:
            on = keeps_checkpoint(i, settings.activation_checkpointing_fraction)
            i += 1
        flags.append(on)
    return flags


def stage_ranges(footprints: list[LayerFootprint], stages: int, bounds: list[int] | None = None) -> list[range]:
    """The layers of each stage: ``bounds`` as the engine reports them, else split by parameter bytes."""
    n = len(footprints)
    if stages <= 1:
        return [range(n)]
    if bounds is None:
        weights = [fp.weights + 1 for fp in footprints]
        total, bounds, acc = sum(weights), [0], 0
        for i, w in enumerate(weights):
            acc += w
            if len(bounds) < stages and acc >= total * len(bounds) / stages:
                bounds.append(i + 1)
        bounds = bounds[:stages] + [n]
    return [range(bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1)]


def estimate(footprints: list[LayerFootprint], settings: MemorySettings, training: Training,
             bounds: list[int] | None = None) -> list[StageEstimate]:
    """The peak of each pipeline stage under ``settings``."""
    flags = checkpointed_flags(footprints, settings)
    fp8 = training.fp8_weights or training.fp8_compute
    out = []
    for s, layers in enumerate(stage_ranges(footprints, training.stages, bounds)):
        # 1F1B: stage s holds the activations of up to (stages - s) micro-batches at once
        in_flight = max(1, min(training.stages - s, training.micro_batches))
        weights = sum(_weights(footprints[i], fp8) for i in layers)
        host = 0
        blocks = [_weights(footprints[i], fp8) for i in layers if footprints[i].checkpointable]
        swapped = blocks[len(blocks) - settings.blocks_to_swap:] if settings.blocks_to_swap else []
        if swapped:   # the stage's last blocks (swap.py); one in use and the next one arriving
            weights += -sum(swapped) + 2 * max(swapped)
            host += sum(swapped)
        kept, recompute = 0, 0
        for i in layers:
            fp = footprints[i]
            if flags[i]:
                block_input = footprints[i - 1].output if i > 0 else fp.output
                mode = settings.activation_checkpointing
                if mode == "unsloth":
                    host += block_input * in_flight
                else:
                    kept += block_input * (3 if mode == "selective" else 1) * in_flight
                recompute = max(recompute, fp.saved)
            else:
                kept += fp.saved * in_flight
        adapter = sum(footprints[i].trainable for i in layers) * training.state_bytes_per_param
        transient = 2 * max((footprints[i].output for i in layers), default=0)
        # fp8_compute: the stage's weights are on the GPU in bf16 until the engine converts them
        loading = sum(footprints[i].weights for i in layers) + adapter if training.fp8_compute else 0
        out.append(StageEstimate(weights=weights, adapter=adapter, activations=kept + recompute,
                                 transient=transient, host=host, loading=loading))
    return out


def peak(stages: list[StageEstimate]) -> int:
    """The largest stage's GPU bytes: what must fit."""
    return max(st.gpu for st in stages)


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB / 10 else f"{n / 2 ** 20:.1f} MiB"


def _weights(fp: LayerFootprint, fp8: bool) -> int:
    return fp.weights - fp.linear_weights // 2 if fp8 else fp.weights


def usable_bytes(gpu_total: int, whole_gpu: bool = True) -> int:
    """What the plan may fill: a share of ``gpu_total``, less the CUDA context where it is the whole GPU (a
    ``memory_limit_gib`` is what PyTorch may allocate)."""
    return int(gpu_total * HEADROOM) - (CONTEXT_BYTES if whole_gpu else 0)


def choose(footprints: list[LayerFootprint], training: Training, gpu_total: int, whole_gpu: bool = True,
           bounds: list[int] | None = None) -> tuple[MemorySettings, list[StageEstimate]] | None:
    """The fastest settings whose every stage fits ``gpu_total`` bytes, with their estimates; None when even
    every block checkpointed with its input in CPU memory and swapped does not fit."""
    limit = usable_bytes(gpu_total, whole_gpu)
    blocks = max((sum(footprints[i].checkpointable for i in r) for r in stage_ranges(footprints, training.stages,
                                                                                      bounds)), default=0)
    for settings in (MemorySettings(mode, frac) for mode, frac in _CHECKPOINTING):
        stages = estimate(footprints, settings, training, bounds)
        if peak(stages) <= limit:
            return settings, stages
    if not training.can_swap:
        return None
    # Swapping: the step waits on what crosses to and from CPU memory each step (swapped blocks' weights, and
    # with 'unsloth' every block's input), so of the settings that fit, the fewest bytes parked there.
    fitting = []
    for n in range(1, max(blocks - 1, 0)):
        for mode in (True, "unsloth"):
            settings = MemorySettings(mode, 1.0, n)
            stages = estimate(footprints, settings, training, bounds)
            if peak(stages) <= limit:
                fitting.append((sum(st.host for st in stages), n, settings, stages))
    if not fitting:
        return None
    _, _, settings, stages = min(fitting, key=lambda c: c[:2])
    return settings, stages


def report(settings: MemorySettings, stages: list[StageEstimate], gpu_total: int | None = None) -> str:
    """One line per stage, in GiB."""
    lines = [f"memory plan: {settings.describe()}"]
    for s, st in enumerate(stages):
        fits = "" if gpu_total is None else f" of {gpu_total / GIB:.1f} GiB"
        notes = f"; {st.host / GIB:.1f} GiB in CPU memory" if st.host else ""
        if st.loading > st.training:
            notes += "; the peak is while loading, before fp8_compute converts the weights"
        lines.append(f"  stage {s}: {st.gpu / GIB:.1f} GiB{fits} (weights {st.weights / GIB:.1f}, adapter and "
                     f"optimizer {st.adapter / GIB:.1f}, activations {st.activations / GIB:.1f}, backward buffers "
                     f"{st.transient / GIB:.1f}){notes}")
    return "\n".join(lines)


def apply(cfg, settings: MemorySettings):
    """``cfg`` (a RunConfig) with ``settings``' keys replaced."""
    return dataclasses.replace(cfg, **dataclasses.asdict(settings))


# --- a run's figures ------------------------------------------------------------------------------------
def trace_run(cfg, inputs_of) -> list[LayerFootprint]:
    """The footprints of ``cfg``'s model with its adapter (or trained whole), traced on ``inputs_of(adapter)``:
    a micro-batch on the CPU (``meta_trace.probe_inputs``, or one built from the cache)."""
    from ..adapters import injection
    from ..models.base import DTYPES
    from ..models.loading import build_meta_model
    from ..models.meta_trace import to_meta_where_large, trace_layers
    from ..models.registry import adapter_class

    adapter = adapter_class(cfg.model.type)(cfg.model, cfg.resolve)
    dtype = DTYPES[cfg.model.diffusion_model_dtype or cfg.model.dtype]
    # float8 weights count one byte each and compute in the run's dtype, as ComfyUI loads them (without the cast
    # the trace's activations would be float8 too, which the pipeline layers cannot carry)
    cast = DTYPES[cfg.model.dtype] if stores_fp8(cfg) else None
    adapter.use_model(build_meta_model(adapter.model_files()["diffusion_model"][0], dtype, cfg.model.type, cast))
    dm = adapter.diffusion_model
    if cfg.adapter is None:
        dm.requires_grad_(True)
    else:
        injection.inject_configured(cfg, dm, adapter.lora_block_prefixes)
    layers = adapter.to_layers()
    return trace_layers(layers, to_meta_where_large(inputs_of(adapter)))


def training_of(cfg) -> Training:
    from ..models.base import DTYPES

    full = cfg.adapter is None
    lora_bytes = DTYPES[cfg.adapter.dtype].itemsize if not full and cfg.adapter.dtype else 4
    return Training(state_bytes_per_param=state_bytes_per_param(lora_bytes, cfg.optimizer.type, full),
                    micro_batches=cfg.gradient_accumulation_steps, stages=cfg.pipeline_stages,
                    fp8_compute=cfg.fp8_compute and not full and not stores_fp8(cfg),
                    can_swap=not full and not cfg.fp8_compute)


def stores_fp8(cfg) -> bool:
    """Whether the run loads its diffusion model's weights as float8 (``diffusion_model_dtype``)."""
    return str(cfg.model.diffusion_model_dtype or cfg.model.dtype).startswith("float8")


def settings_of(cfg) -> MemorySettings:
    return MemorySettings(cfg.activation_checkpointing, cfg.activation_checkpointing_fraction, cfg.blocks_to_swap)


def does_not_fit(cfg, footprints: list[LayerFootprint], gpu_total: int, whole_gpu: bool = True) -> str:
    """What to say when nothing fits: the smallest estimate, and the smallest change that would fit (float8
    weights, or the fewest pipeline stages) where one does."""
    training = training_of(cfg)
    last = MemorySettings(True, 1.0, max(sum(fp.checkpointable for fp in footprints) // training.stages - 2, 0))
    need = peak(estimate(footprints, last, training))
    text = (f"even with every block checkpointed and {last.blocks_to_swap} blocks swapped to CPU memory a stage "
            f"needs about {gib(need)}, and {gib(usable_bytes(gpu_total, whole_gpu))} of {gib(gpu_total)} can be "
            "planned")
    fixes = smallest_changes(cfg, footprints, training, gpu_total, whole_gpu)
    if fixes:
        return f"{text}. The smallest change that fits: {' or '.join(fixes)}"
    return (f"{text}: train on more GPUs (pipeline_stages), lower the resolution, frames or micro_batch_size_per_gpu, "
            "or load the model in float8 (diffusion_model_dtype = 'float8_e4m3fn')")


MAX_STAGES = 8   # one machine's GPUs: the most stages a suggestion names


def smallest_changes(cfg, footprints: list[LayerFootprint], training: Training, gpu_total: int,
                     whole_gpu: bool) -> list[str]:
    """The changes that make ``choose`` find settings, each the least of its kind: float8 base weights (where they
    are not float8 already), and the fewest pipeline stages that fit (each stage its own GPU)."""
    fixes = []
    if not stores_fp8(cfg):
        fp8 = choose(footprints, dataclasses.replace(training, fp8_weights=True, fp8_compute=False), gpu_total,
                     whole_gpu)
        if fp8:
            fixes.append(f"diffusion_model_dtype = 'float8_e4m3fn' ({fp8[0].describe()}, "
                         f"{gib(peak(fp8[1]))} per stage)")
    for stages in range(training.stages + 1, min(MAX_STAGES, len(footprints)) + 1):
        more = choose(footprints, dataclasses.replace(training, stages=stages), gpu_total, whole_gpu)
        if more:
            fixes.append(f"pipeline_stages = {stages} on {stages} GPUs ({more[0].describe()}, "
                         f"{gib(peak(more[1]))} per stage)")
            break
    return fixes
