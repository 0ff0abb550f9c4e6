# SPDX-License-Identifier: GPL-3.0-or-later
"""``memory = "auto"``: before the model is loaded, rank 0 traces it at the run's largest cached micro-batch
(``memory/plan.py``) and every rank takes the fastest checkpointing and swapping that fit the smallest GPU of
the run (or ``memory_limit_gib``); the choice and its per-stage figures go to the run's events."""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from ..memory import plan as mp
from ..config import RunConfig
from ..errors import ConfigError
from . import distributed
from .parts import CachedData, Topology

log = logging.getLogger(__name__)


def gpu_bytes(cfg: RunConfig) -> int | None:
    """This rank's memory to plan for: the limit, the GPU's total, or None (no GPU and no limit)."""
    if cfg.memory_limit_gib is not None:
        return int(cfg.memory_limit_gib * mp.GIB)
    device = distributed.device()
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def largest_entry(data: CachedData):
    """The entry whose latent has the most elements (one per bucket is read): the micro-batch with the peak."""
    first_of_bucket = {}
    for e in data.entries:
        first_of_bucket.setdefault(e.bucket, e)
    sizes = {b: data.store.get("latents", e.latent)["latent"].numel() for b, e in first_of_bucket.items()}
    return first_of_bucket[max(sizes, key=sizes.get)]


def planning_inputs(cfg: RunConfig, data: CachedData, entry):
    """A micro-batch of ``entry`` repeated to the rows of the run's micro-batch size, as the feed builds one
    (``feed.py``)."""
    from ..data.epoch_plan import micro_batch_for

    payload = data.store.get("latents", entry.latent)
    latent = payload["latent"].float()
    from .preservation import PARTS

    # diff_output_preservation: the pipeline carries each sample's two preservation rows too
    batch = micro_batch_for(cfg, entry.bucket) * (PARTS if cfg.diff_output_preservation else 1)

    def inputs_of(adapter):
        latents = latent.expand(batch, *latent.shape).contiguous()
        conditioning = [payload[name][None].expand(batch, *payload[name].shape).contiguous()
                        for name in adapter.conditioning_fields]
        text = adapter.collate_text([data.store.get("text", entry.text)] * batch)
        return (latents, torch.zeros_like(latents), torch.full((batch,), 0.6), *text, *conditioning)
    return inputs_of


ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


def less_fragmentation(settings: mp.MemorySettings, environ) -> str | None:
    """The allocator setting the plan switches on for its settings, None where it leaves the allocator as it is.

    A plan fills its GPU (or ``memory_limit_gib``) to a fixed share, and checkpointing and swapping free and take
    blocks of many sizes every step: PyTorch's default allocator then keeps freed blocks it cannot reuse, and a run
    whose allocations fit the plan still runs out of memory (seen under a 16 GiB cap with block swapping). Expandable
    segments map memory into growing segments instead, so freed memory is reused. Settings without checkpointing or
    swapping may replay CUDA graphs, whose private pools are left to PyTorch's default; a user's own
    ``PYTORCH_CUDA_ALLOC_CONF`` is always left as it is."""
    if ALLOC_CONF_ENV in environ:
        return None
    if not settings.activation_checkpointing and not settings.blocks_to_swap:
        return None
    return EXPANDABLE


def use_allocator(setting: str) -> None:
    """Switch the CUDA caching allocator to ``setting`` in this rank (segments made from now on follow it), and
    pass it to the processes the rank starts (the sample renderer)."""
    torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings(setting)
    os.environ[ALLOC_CONF_ENV] = setting


def plan_memory(cfg: RunConfig, data: CachedData, topology: Topology, reporter) -> RunConfig:
    """``cfg`` with the settings the plan chose (``memory = "auto"``), the same on every rank."""
    totals = [t for t in distributed.all_gather_object(gpu_bytes(cfg)) if t is not None]
    if not totals:
        if topology.is_main:
            reporter.event("memory_plan", chosen=None, reason="no GPU and no memory_limit_gib: nothing to plan for")
        return cfg
    total, whole_gpu = min(totals), cfg.memory_limit_gib is None
    outcome = None
    if topology.is_main:
        try:
            footprints = mp.trace_run(cfg, planning_inputs(cfg, data, largest_entry(data)))
        except Exception as e:  # noqa: BLE001  (a model the trace cannot run: train with the config's settings)
            outcome = ("untraced", f"{type(e).__name__}: {e}")
        else:
            chosen = mp.choose(footprints, mp.training_of(cfg), total, whole_gpu)
            outcome = ("fits", chosen) if chosen else ("too_big", mp.does_not_fit(cfg, footprints, total, whole_gpu))
    kind, value = distributed.broadcast_object(outcome)
    if kind == "too_big":
        raise ConfigError(f"memory = 'auto': {value}", file=cfg.file, key="memory")
    if kind == "untraced":
        if topology.is_main:
            message = (f"memory = 'auto': this model could not be traced ({value}); training with the config's own "
                       "activation_checkpointing and blocks_to_swap")
            log.warning(message)
            reporter.event("warning", message=message)
        return cfg
    settings, stages = value
    allocator = less_fragmentation(settings, os.environ) if distributed.device().type == "cuda" else None
    if topology.is_main:
        text = mp.report(settings, stages, total) + (f"; CUDA allocator: {allocator}" if allocator else "")
        log.info(text)
        reporter.event("memory_plan", chosen=dataclasses.asdict(settings), gpu_gib=round(total / mp.GIB, 2),
                       allocator=allocator,
                       stages_gib=[round(st.gpu / mp.GIB, 3) for st in stages], message=text)
        reporter.update(memory={"chosen": settings.describe(), "gpu_gib": round(total / mp.GIB, 2),
                                "stages_gib": [round(st.gpu / mp.GIB, 2) for st in stages]})
    if allocator:
        use_allocator(allocator)
    return mp.apply(cfg, settings)
