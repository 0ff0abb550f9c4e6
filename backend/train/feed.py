"""Feeds DeepSpeed's pipeline engine: one step's micro-batches as (inputs, labels) tuples.

The engine pulls the data iterator on the first stage (inputs) and on the last stage (labels). Both
build the identical micro-batch: the same plan, the same cached tensors, and noise and timesteps drawn
from a generator seeded by (seed, epoch, step, micro-batch, data-parallel rank). The loss target
therefore never travels between stages and no extra communication can deadlock the schedule.
"""
from __future__ import annotations

import hashlib

import torch

from ..cache import CacheStore


def micro_seed(seed: int, epoch: int, step: int, micro: int, dp_rank: int) -> int:
    digest = hashlib.sha256(f"{seed}:{epoch}:{step}:{micro}:{dp_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class MicroBatchFeed:
    def __init__(self, adapter, store: CacheStore, seed: int, dp_rank: int):
        self.adapter = adapter
        self.store = store
        self.seed = seed
        self.dp_rank = dp_rank
        self.objective = adapter.objective()

    def build(self, entries, epoch: int, step: int, micro: int):
        latents = torch.stack([self.store.get("latents", e.latent)["latent"] for e in entries]).float()
        text = self.adapter.collate_text([self.store.get("text", e.text) for e in entries])
        g = torch.Generator().manual_seed(micro_seed(self.seed, epoch, step, micro, self.dp_rank))
        noise = torch.randn(latents.shape, generator=g)
        seq_len = latents.shape[-1] * latents.shape[-2] // 4
        t = self.objective.sample_t(latents.shape[0], seq_len, g)
        return (latents, noise, t, *text), (latents, noise, t)

    def step_iter(self, micro_batches, epoch: int, step: int):
        for micro, entries in enumerate(micro_batches):
            yield self.build(entries, epoch, step, micro)
