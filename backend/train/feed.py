"""Feeds DeepSpeed's pipeline engine: one step's micro-batches as (inputs, labels) tuples.

The engine pulls the data iterator on the first stage (inputs) and on the last stage (labels). Both
build the identical micro-batch: the same plan, the same cached tensors, and noise and timesteps drawn
per sample from a generator seeded by (seed, epoch, step, the sample's position in the global batch).
The loss target therefore never travels between stages, no extra communication can deadlock the
schedule, and the same global batch gets the same noise however it is split into micro-batches,
accumulation steps and data-parallel ranks.
"""
from __future__ import annotations

import hashlib

import torch

from ..cache import CacheStore


def sample_seed(seed: int, epoch: int, step: int, position: int) -> int:
    digest = hashlib.sha256(f"{seed}:{epoch}:{step}:{position}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class MicroBatchFeed:
    def __init__(self, adapter, store: CacheStore, seed: int, dp_rank: int, dp_world: int):
        self.adapter = adapter
        self.store = store
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.objective = adapter.objective()

    def _noise_and_t(self, latent: torch.Tensor, epoch: int, step: int, position: int):
        g = torch.Generator().manual_seed(sample_seed(self.seed, epoch, step, position))
        noise = torch.randn(latent.shape, generator=g)
        seq_len = latent.shape[-1] * latent.shape[-2] // 4
        return noise, self.objective.sample_t(1, seq_len, g)

    def build(self, entries, epoch: int, step: int, micro: int):
        latents = torch.stack([self.store.get("latents", e.latent)["latent"] for e in entries]).float()
        text = self.adapter.collate_text([self.store.get("text", e.text) for e in entries])
        first = (micro * self.dp_world + self.dp_rank) * len(entries)
        drawn = [self._noise_and_t(lat, epoch, step, first + i) for i, lat in enumerate(latents)]
        noise = torch.stack([n for n, _ in drawn])
        t = torch.cat([t for _, t in drawn])
        return (latents, noise, t, *text), (latents, noise, t)

    def step_iter(self, micro_batches, epoch: int, step: int):
        for micro, entries in enumerate(micro_batches):
            yield self.build(entries, epoch, step, micro)
