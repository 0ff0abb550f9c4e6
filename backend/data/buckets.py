"""Aspect-ratio buckets: which (width, height) sizes exist, and which one an image trains at."""
from __future__ import annotations

import math

from ..config import DatasetConfig
from .items import MediaItem, Sample

# Latent patches of the supported models need pixel sides divisible by 16.
SIDE_MULTIPLE = 16


def _round_side(length: float) -> int:
    return max(SIDE_MULTIPLE, math.floor(length / SIDE_MULTIPLE + 0.5) * SIDE_MULTIPLE)


def _aspect_ratios(min_ar: float, max_ar: float, count: int) -> list[float]:
    """`count` ratios spaced evenly in log space from min_ar to max_ar (one: their geometric middle)."""
    lo, hi = math.log(min_ar), math.log(max_ar)
    if count == 1:
        return [math.exp((lo + hi) / 2)]
    return [math.exp(lo + i * (hi - lo) / (count - 1)) for i in range(count)]


def make_buckets(resolution: int, enable_ar_bucket: bool, min_ar: float, max_ar: float,
                 num_ar_buckets: int) -> list[tuple[int, int]]:
    """Bucket sizes (width, height) of about resolution² pixels each, sorted and without duplicates."""
    if not enable_ar_bucket:
        side = _round_side(resolution)
        return [(side, side)]
    sizes = {
        (_round_side(resolution * math.sqrt(ar)), _round_side(resolution / math.sqrt(ar)))
        for ar in _aspect_ratios(min_ar, max_ar, num_ar_buckets)
    }
    return sorted(sizes)


def assign_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest the image's, measured in log space (first wins ties)."""
    if not buckets:
        raise ValueError("assign_bucket needs at least one bucket")
    log_ar = math.log(width / height)
    return min(buckets, key=lambda b: abs(log_ar - math.log(b[0] / b[1])))


def build_samples(cfg: DatasetConfig, items: list[MediaItem]) -> list[Sample]:
    """One sample per item and resolution, at the item's bucket; repeats are expanded later."""
    buckets_by_resolution: dict[int, list[tuple[int, int]]] = {}
    samples = []
    for item in items:
        for resolution in item.resolutions:
            if resolution not in buckets_by_resolution:
                buckets_by_resolution[resolution] = make_buckets(
                    resolution, cfg.enable_ar_bucket, cfg.min_ar, cfg.max_ar, cfg.num_ar_buckets)
            bucket = assign_bucket(item.width, item.height, buckets_by_resolution[resolution])
            samples.append(Sample(item=item, bucket=bucket))
    return samples
