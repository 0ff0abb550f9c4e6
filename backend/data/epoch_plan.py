"""Deterministic, single-bucket batches for each epoch and data-parallel rank."""
from __future__ import annotations

import math
import random
from collections import defaultdict

from ..errors import DatasetError
from .items import Example

Bucket = tuple[int, ...]   # (width, height), or (width, height, frames) for video clips


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _is_image(bucket: Bucket) -> bool:
    return len(bucket) < 3 or bucket[2] == 1


def _bucket_name(bucket: Bucket) -> str:
    return "x".join(str(v) for v in bucket[:2]) + (f", {bucket[2]} frames" if len(bucket) > 2 else "")


def batch_for_bucket(pairs: list, bucket: Bucket) -> int:
    """diffusion-pipe's per-resolution batch: the entry whose resolution is nearest sqrt(width x height)."""
    side = math.sqrt(bucket[0] * bucket[1])
    return min(pairs, key=lambda p: (abs(p[0] - side), p[0]))[1]


def micro_batch_for(cfg, bucket: Bucket) -> int:
    """The micro batch a RunConfig gives ``bucket`` ((w, h) a still, (w, h, frames) a clip): what
    ``EpochPlan.micro_batch_size_of`` gives it, for callers without a plan (the memory plan)."""
    image = _is_image(bucket)
    pairs = batches_by_resolution(cfg).get("image" if image else "clip")
    if pairs:
        return batch_for_bucket(pairs, bucket)
    return (cfg.image_micro_batch_size_per_gpu or cfg.micro_batch_size_per_gpu) if image else \
        cfg.micro_batch_size_per_gpu


def batches_by_resolution(cfg) -> dict[str, list]:
    """A RunConfig's lists: images take image_micro_batch_size_by_resolution, else the general one."""
    return _lists(cfg.micro_batch_size_by_resolution, cfg.image_micro_batch_size_by_resolution,
                  cfg.image_micro_batch_size_per_gpu)


def eval_batches_by_resolution(cfg) -> dict[str, list]:
    """The eval lists, diffusion-pipe's defaults: the eval list, else (no eval batch given at all) the training
    list; images take the eval image list, else the eval one (not the training image list)."""
    general = cfg.eval_micro_batch_size_by_resolution or (
        None if cfg.eval_micro_batch_size_per_gpu else cfg.micro_batch_size_by_resolution)
    return _lists(general, cfg.eval_image_micro_batch_size_by_resolution, cfg.eval_image_micro_batch_size_per_gpu)


def _lists(general, image, image_batch) -> dict[str, list]:
    """The image list is its own, else (no image batch given as one integer either) the general one."""
    image = image or (None if image_batch else general)
    return {k: v for k, v in (("clip", general), ("image", image)) if v}


class EpochPlan:
    """Deterministic batches for one epoch for one data-parallel rank.

    Every rank builds the same plan from the same examples and seed, so the ranks agree on the order of
    global batches; each rank then takes its own slice of every micro batch. A global batch never
    mixes buckets, so every micro batch stacks into one tensor. ``image_micro_batch_size`` (default
    ``micro_batch_size``) is the micro batch of one-frame buckets (images), as diffusion-pipe's
    ``image_micro_batch_size_per_gpu``: a video model can batch several images where one clip fills the GPU.

    ``reg`` marks regularisation examples (``is_reg`` directories): they are not all in every epoch, but drawn so
    that they make ``reg_ratio`` of it (``RegDraw``), each bucket the same number every epoch (so every epoch has
    the same steps), shuffled in with the training examples of their bucket.

    ``subsample_ratio`` (diffusion-pipe's dataset key) keeps ``int(global batches x ratio)`` of each epoch's global
    batches, as diffusion-pipe truncates its epoch order; here the kept ones are the first of each epoch's own
    shuffle, so every epoch trains another share (diffusion-pipe's order, and so its share, is the same each epoch).
    """

    def __init__(self, examples: list[Example], repeats: list[int] | None, micro_batch_size: int,
                 grad_accum_steps: int, dp_rank: int, dp_world: int, seed: int,
                 image_micro_batch_size: int | None = None, reg: list[bool] | None = None,
                 reg_ratio: float = 0.5, by_resolution: dict[str, list] | None = None,
                 subsample_ratio: float | None = None):
        if repeats is None:
            repeats = [example.item.num_repeats for example in examples]
        if len(repeats) != len(examples):
            raise ValueError(f"got {len(repeats)} repeat counts for {len(examples)} examples")
        if image_micro_batch_size is None:
            image_micro_batch_size = micro_batch_size
        if min(micro_batch_size, image_micro_batch_size, grad_accum_steps, dp_world) < 1:
            raise ValueError("micro batch sizes, grad_accum_steps and dp_world must each be 1 or more")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_world - 1}")
        self.micro_batch_size = micro_batch_size
        self.image_micro_batch_size = image_micro_batch_size
        self.by_resolution = by_resolution or {}   # {"image": [[res, batch], ...], "clip": [...]}
        self.grad_accum_steps = grad_accum_steps
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.seed = seed
        self.subsample_ratio = subsample_ratio
        reg = reg or [False] * len(examples)
        self._by_bucket = self._expand_and_group([s for s, r in zip(examples, reg) if not r],
                                                 [n for n, r in zip(repeats, reg) if not r])
        pool = self._expand_and_group([s for s, r in zip(examples, reg) if r], [n for n, r in zip(repeats, reg) if r])
        self.reg = RegDraw(pool, sum(map(len, self._by_bucket.values())), reg_ratio, seed)
        for bucket in self.reg.counts:   # a bucket of regularisation images alone
            self._by_bucket.setdefault(bucket, [])
        self._by_bucket = dict(sorted(self._by_bucket.items()))
        # what settings counted in examples are divided by (save_every_n_examples, beta2_half_life): an image
        # dataset's global batch, else a clip's
        all_images = all(_is_image(b) for b in self._by_bucket)
        self.global_batch = (image_micro_batch_size if all_images else micro_batch_size) * grad_accum_steps * dp_world
        if self.steps_per_epoch() == 0:
            raise DatasetError(self._no_steps_message())

    @staticmethod
    def _expand_and_group(examples: list[Example], repeats: list[int]) -> dict[Bucket, list[Example]]:
        grouped: dict[Bucket, list[Example]] = defaultdict(list)
        for example, count in zip(examples, repeats):
            grouped[example.bucket].extend([example] * count)
        return {bucket: grouped[bucket] for bucket in sorted(grouped)}

    def micro_batch_size_of(self, bucket: Bucket) -> int:
        """A one-frame bucket (an image) batches ``image_micro_batch_size`` examples, a clip ``micro_batch_size``;
        a per-resolution list for its kind (``by_resolution``) decides first."""
        image = _is_image(bucket)
        pairs = self.by_resolution.get("image" if image else "clip")
        if pairs:
            return batch_for_bucket(pairs, bucket)
        return self.image_micro_batch_size if image else self.micro_batch_size

    def global_batch_of(self, bucket: Bucket) -> int:
        return self.micro_batch_size_of(bucket) * self.grad_accum_steps * self.dp_world

    def _sizes(self) -> dict[Bucket, int]:
        """Examples of each bucket in every epoch: its training examples and the regularisation ones drawn."""
        return {bucket: len(group) + self.reg.counts.get(bucket, 0) for bucket, group in self._by_bucket.items()}

    def _global_batches(self) -> int:
        """Global batches of an epoch before ``subsample_ratio``."""
        return sum(n // self.global_batch_of(bucket) for bucket, n in self._sizes().items())

    def steps_per_epoch(self) -> int:
        full = self._global_batches()
        # diffusion-pipe's int(len(order) * ratio), float rounding included; a ratio of 0 or None keeps all
        return int(full * self.subsample_ratio) if self.subsample_ratio else full

    def dropped(self) -> dict[Bucket, int]:
        """Examples (after repeats) left out of each bucket every epoch because they fill no global batch."""
        return {bucket: n % self.global_batch_of(bucket) for bucket, n in self._sizes().items()}

    def warnings(self) -> list[str]:
        """One message for each bucket too small to give even one global batch."""
        return [
            f"bucket {_bucket_name(bucket)} has {_plural(n, 'example')}, fewer than one global batch of "
            f"{self.global_batch_of(bucket)}: it is not trained; add images of this shape, raise its num_repeats, "
            "or lower the global batch (micro batch size x gradient accumulation steps x data-parallel GPUs)"
            for bucket, n in self._sizes().items() if n < self.global_batch_of(bucket)
        ]

    def epoch(self, epoch: int) -> list[list[list[Example]]]:
        """This rank's batches as [step][micro batch][example]; the same for the same (seed, epoch)."""
        # A string seed is hashed with SHA-512, so the order does not depend on PYTHONHASHSEED or platform.
        rng = random.Random(f"pipetrain-epoch:{self.seed}:{epoch}")
        global_batches = []
        for bucket, group in self._by_bucket.items():
            shuffled = list(group) + self.reg.draw(bucket, epoch)
            rng.shuffle(shuffled)
            size = self.global_batch_of(bucket)
            usable = len(shuffled) - len(shuffled) % size
            global_batches += [shuffled[i:i + size] for i in range(0, usable, size)]
        rng.shuffle(global_batches)
        return [self._rank_slice(batch) for batch in global_batches[:self.steps_per_epoch()]]

    def _rank_slice(self, global_batch: list[Example]) -> list[list[Example]]:
        """This rank's micro batches of one global batch: micro batch m holds ranks' slices side by side."""
        size = len(global_batch) // (self.grad_accum_steps * self.dp_world)
        starts = ((m * self.dp_world + self.dp_rank) * size for m in range(self.grad_accum_steps))
        return [global_batch[start:start + size] for start in starts]

    def _no_steps_message(self) -> str:
        sizes = self._sizes()
        total = sum(sizes.values())
        if total == 0:
            return "the dataset has no examples, so an epoch has no steps; check the dataset directories"
        if self._global_batches():
            batches = self._global_batches()
            return (f"subsample_ratio = {self.subsample_ratio} keeps none of the epoch's {batches} global "
                    f"batch{'es' if batches > 1 else ''} (it keeps int(global batches x ratio)); "
                    "raise subsample_ratio, or remove it to train on every batch")
        counts = ", ".join(f"{_bucket_name(b)}: {n}" for b, n in sizes.items())
        return (
            f"the dataset has {_plural(total, 'example')} (after repeats) in "
            f"{_plural(len(sizes), 'bucket')} ({counts}), but the global batch size is "
            f"{self.global_batch} (micro batch {self.micro_batch_size} x gradient accumulation "
            f"{self.grad_accum_steps} x {_plural(self.dp_world, 'data-parallel GPU')}) and no bucket fills one "
            "global batch, so an epoch has no steps. Use fewer GPUs, a smaller micro_batch_size_per_gpu or "
            "fewer gradient_accumulation_steps; raise num_repeats; or use fewer buckets (fewer resolutions, "
            "a smaller num_ar_buckets, or enable_ar_bucket = false)."
        )


class RegDraw:
    """Which regularisation examples each epoch trains on. ``reg_ratio`` of the epoch's examples: with ``n`` training
    examples, ``round(n * ratio / (1 - ratio))`` of them, split over the buckets in proportion to the examples each
    holds (largest remainders first), the same counts every epoch. Each bucket's examples come in turn from its
    pool, shuffled anew on every pass through it: every one is drawn once before any is drawn again."""

    def __init__(self, pool: dict[Bucket, list], training_examples: int, ratio: float, seed: int):
        self.pool, self.seed = pool, seed
        total = sum(map(len, pool.values()))
        wanted = round(training_examples * ratio / (1 - ratio)) if total else 0
        exact = {bucket: wanted * len(group) / total for bucket, group in pool.items()}
        self.counts = {bucket: int(share) for bucket, share in exact.items()}
        left = wanted - sum(self.counts.values())
        for bucket in sorted(exact, key=lambda b: (-(exact[b] % 1), b))[:left]:
            self.counts[bucket] += 1
        self.counts = {bucket: n for bucket, n in self.counts.items() if n}

    def draw(self, bucket: Bucket, epoch: int) -> list:
        """This epoch's regularisation examples of ``bucket`` (epochs count from 1, as the trainer's do)."""
        n = self.counts.get(bucket, 0)
        if not n:
            return []
        size = len(self.pool[bucket])
        start = max(epoch - 1, 0) * n
        passes = {}
        for cycle in range(start // size, (start + n - 1) // size + 1):
            passes[cycle] = self._pass(bucket, cycle)
        return [passes[p // size][p % size] for p in range(start, start + n)]

    def _pass(self, bucket: Bucket, cycle: int) -> list:
        shuffled = list(self.pool[bucket])
        random.Random(f"pipetrain-reg:{self.seed}:{bucket}:{cycle}").shuffle(shuffled)
        return shuffled
