# SPDX-License-Identifier: GPL-3.0-or-later
"""Stand-ins for what ``train.feed.MicroBatchFeed`` reads: a cache store, a flow-matching adapter and cache entries
(the feed's tests build micro-batches from them without a model or a cache on disk)."""
import torch


class Store:
    """Cached tensors keyed by name: each text embedding is a 1-element tensor holding its key's id."""
    def __init__(self):
        self.ids = {}

    def get(self, kind, key, encode_again=None, needs=()):
        if kind == "latents":
            g = torch.Generator().manual_seed(len(key))
            return {"latent": torch.randn(16, 4, 4, generator=g)}
        return {"x": torch.tensor([float(self.ids.setdefault(key, len(self.ids)))])}


class FlowAdapter:
    conditioning_fields = ()

    def objective(self):
        from pipetrain.backend.models.objectives import FlowMatching
        return FlowMatching()

    def collate_text(self, items):
        return [torch.stack([it["x"] for it in items])]


def cache_entries(n):
    from pipetrain.backend.cache.manifest import CacheEntry
    return [CacheEntry(path=f"{i}.png", bucket=(32, 32), caption=f"c{i}", num_repeats=1, latent=f"lat{i}" * (i + 1),
                       text=f"text{i}") for i in range(n)]
