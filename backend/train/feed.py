"""Feeds DeepSpeed's pipeline engine: one step's micro-batches as (inputs, labels) tuples.

The engine pulls the data iterator on the first stage (inputs) and on the last stage (labels). Both
build the identical micro-batch: the same plan, the same cached tensors, and noise and timesteps drawn
per sample from a generator seeded by (seed, epoch, step, the sample's position in the global batch).
The loss target therefore never travels between stages, no extra communication can deadlock the
schedule, and the same global batch gets the same noise however it is split into micro-batches,
accumulation steps and data-parallel ranks.

On a GPU the feed hands the engine device tensors, copied without blocking from pinned host memory: the
engine's own ``.to(device)`` of a host tensor waits until the device has finished all the work queued
before it, the previous step included, and the device would idle while the host queues the next one.
"""
from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import torch

from ..cache import CacheStore
from .preservation import PARTS


EXTRA_NOISE_SEED = 0x5EED   # xor-ed into a sample's seed: its further noise, apart from its latent's noise and t


def sample_seed(seed: int, epoch: int, step: int, position: int) -> int:
    digest = hashlib.sha256(f"{seed}:{epoch}:{step}:{position}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class MicroBatchFeed:
    def __init__(self, adapter, store: CacheStore, seed: int, dp_rank: int, dp_world: int,
                 uncond_text: dict[str, str] | None = None, uncond_fraction: float = 0.0,
                 device: torch.device | None = None, reg_labels: bool = False, noise_offset: float = 0.0,
                 masks: bool = False, preservation_text: dict[str, str] | None = None):
        self.adapter = adapter
        self.device = device if device is not None and device.type == "cuda" else None   # None: host tensors
        self.store = store
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.objective = adapter.objective()
        self.uncond_text = uncond_text          # caption dropout: text key -> the empty caption's key
        self.uncond_fraction = uncond_fraction if uncond_text else 0.0
        self.reg_labels = reg_labels            # the labels end with which samples are regularisation ones
        self.noise_offset = noise_offset
        self.masks = masks                      # the labels carry each sample's loss mask (all ones without one)
        # diff_output_preservation: text key -> its preservation caption's; the inputs get the preservation rows
        self.preservation_text = preservation_text
        self._pool: ThreadPoolExecutor | None = None
        self._prefetched = None                 # ((epoch, step, micro_batches), Future) of the next step

    def _encode_latent(self, entry) -> None:
        """A damaged cached latent, encoded again as the caching phase encodes it (the store warns)."""
        from ..cache.builder import encode_latents
        encode_latents(self.adapter, self.store, {entry.latent: entry}, 1, lambda *_: None)

    def _encode_text(self, entry) -> None:
        from ..cache.builder import encode_texts, entry_text_work
        encode_texts(self.adapter, self.store, {entry.text: entry_text_work(entry)}, lambda *_: None)

    def _text_key(self, entry, epoch: int, step: int, position: int) -> str:
        from ..data import drops_caption

        if drops_caption(self.seed, epoch, step, position, self.uncond_fraction):
            return self.uncond_text[entry.text]
        return entry.text

    def _seed(self, epoch: int, step: int, position: int, entry) -> int:
        return sample_seed(self.seed, epoch, step, position)

    def _noise_and_t(self, latent: torch.Tensor, epoch: int, step: int, position: int, entry=None):
        g = torch.Generator().manual_seed(self._seed(epoch, step, position, entry))
        noise = torch.randn(latent.shape, generator=g)
        t = self.objective.sample_t(1, self.seq_len(latent), g)
        if self.noise_offset:
            # ai-toolkit's noise offset: one Gaussian shift per channel of the sample, drawn after t so that the
            # noise and t of a run without it stay what they were
            channels = (latent.shape[0],) + (1,) * (latent.ndim - 1)
            noise = noise + self.noise_offset * torch.randn(channels, generator=g)
        return noise, t

    def seq_len(self, latent: torch.Tensor) -> int:
        """The token count the timestep shift reads (the adapter's ``seq_len``; Flux's rule for stand-ins)."""
        fn = getattr(self.adapter, "seq_len", None)
        return fn(latent) if fn else latent.shape[-1] * latent.shape[-2] // 4

    def build(self, entries, epoch: int, step: int, micro: int):
        payloads = [self.store.get("latents", e.latent, lambda e=e: self._encode_latent(e), needs=("latent",))
                    for e in entries]
        latents = torch.stack([p["latent"] for p in payloads]).float()
        conditioning = [torch.stack([p[name] for p in payloads]) for name in self.adapter.conditioning_fields]
        first = (micro * self.dp_world + self.dp_rank) * len(entries)
        keys = [self._text_key(e, epoch, step, first + i) for i, e in enumerate(entries)]
        texts = [self.store.get("text", k, (lambda e=e: self._encode_text(e)) if k == e.text else None)
                 for k, e in zip(keys, entries)]
        if self.preservation_text is not None:   # preservation.py: [training | preservation | preservation] rows
            kept = [self.store.get("text", self.preservation_text[e.text]) for e in entries]
            texts += kept + kept
        text = self.adapter.collate_text(texts)
        drawn = [self._noise_and_t(lat, epoch, step, first + i, e) for i, (lat, e) in enumerate(zip(latents, entries))]
        noise = torch.stack([n for n, _ in drawn])
        t = torch.cat([t for _, t in drawn])
        labels = (latents, noise, t)
        extra_noise = getattr(self.adapter, "extra_noise_shape", None)
        shapes = [extra_noise(p) if extra_noise else None for p in payloads]
        if shapes[0] is not None:   # the first layer's further noise (VACE's reference frame): a seed of its own
            conditioning.append(torch.stack([
                torch.randn(shape, generator=torch.Generator().manual_seed(
                    self._seed(epoch, step, first + i, e) ^ EXTRA_NOISE_SEED))
                for i, (shape, e) in enumerate(zip(shapes, entries))]))
        if self.masks:   # masked training: weights on the latent grid, broadcast over channels (and frames)
            labels += (torch.stack([p["mask"] if "mask" in p else _no_mask(p["latent"]) for p in payloads]),)
        if self.reg_labels:   # for the loss logged per kind (reg_loss.py)
            labels += (torch.tensor([e.is_reg for e in entries], dtype=torch.bool),)
        inputs = (latents, noise, t)
        if self.preservation_text is not None:   # the same noisy latent in each part; the labels are the training rows'
            inputs, conditioning = ([torch.cat([x] * PARTS) for x in xs] for xs in (inputs, conditioning))
        batch = (*inputs, *text, *conditioning), labels
        return _map_tensors(batch, torch.Tensor.pin_memory) if self.device is not None else batch

    def step_iter(self, micro_batches, epoch: int, step: int):
        ready = self._take_prefetched(micro_batches, epoch, step)
        for micro, entries in enumerate(micro_batches):
            batch = ready[micro] if ready is not None else self.build(entries, epoch, step, micro)
            if self.device is not None:
                batch = _map_tensors(batch, lambda x: x.to(self.device, non_blocking=True))
            yield batch

    def prefetch(self, micro_batches, epoch: int, step: int) -> None:
        """Start building this step's micro-batches in a worker thread: the loop calls it for the next step as
        soon as the current one is queued, so reading the cache and drawing noise happen while the GPU computes
        instead of between steps (waits on the accelerator release the GIL)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pipetrain-feed")
        self._prefetched = ((epoch, step, micro_batches), self._pool.submit(
            lambda: [self.build(entries, epoch, step, micro) for micro, entries in enumerate(micro_batches)]))

    def _take_prefetched(self, micro_batches, epoch: int, step: int):
        if self._prefetched is None:
            return None
        (key, future), self._prefetched = self._prefetched, None
        result = future.result()            # a failed build raises here, in the loop
        return result if key[:2] == (epoch, step) and key[2] is micro_batches else None


def _no_mask(latent: torch.Tensor) -> torch.Tensor:
    return torch.ones((1,) * (latent.ndim - 2) + tuple(latent.shape[-2:]))


def _map_tensors(batch, fn):
    """``fn`` applied to every tensor of a micro-batch's nested tuples, once per tensor (the labels are the
    inputs' first tensors)."""
    done: dict[int, torch.Tensor] = {}

    def visit(x):
        if isinstance(x, tuple):
            return tuple(visit(v) for v in x)
        if torch.is_tensor(x):
            if id(x) not in done:
                done[id(x)] = fn(x)
            return done[id(x)]
        return x
    return visit(batch)
