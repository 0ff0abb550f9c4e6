"""Aspect-ratio buckets: which (width, height) sizes exist, and which one an image trains at."""
from __future__ import annotations

import logging
import math

from ..config import DatasetConfig
from ..errors import DatasetError
from .items import MediaItem, Example

log = logging.getLogger(__name__)

# Latent patches of most models need pixel sides divisible by 16; an adapter says when it needs more
# (``ModelAdapter.spatial_multiple``: 32 for 16x/32x VAEs and SDXL's UNet).
SIDE_MULTIPLE = 16


def _round_side(length: float, multiple: int = SIDE_MULTIPLE) -> int:
    return max(multiple, math.floor(length / multiple + 0.5) * multiple)


def _aspect_ratios(min_ar: float, max_ar: float, count: int) -> list[float]:
    """`count` ratios spaced evenly in log space from min_ar to max_ar (one: their geometric middle)."""
    lo, hi = math.log(min_ar), math.log(max_ar)
    if count == 1:
        return [math.exp((lo + hi) / 2)]
    return [math.exp(lo + i * (hi - lo) / (count - 1)) for i in range(count)]


def make_buckets(resolution: int, enable_ar_bucket: bool, min_ar: float, max_ar: float,
                 num_ar_buckets: int, multiple: int = SIDE_MULTIPLE,
                 ratios: list[float] | None = None) -> list[tuple[int, int]]:
    """Bucket sizes (width, height) of about resolution² pixels each, sides multiples of ``multiple``, sorted
    and without duplicates; ``ratios`` (``ar_buckets``) replace the ones spaced from min_ar to max_ar."""
    if not enable_ar_bucket:
        side = _round_side(resolution, multiple)
        return [(side, side)]
    sizes = {
        (_round_side(resolution * math.sqrt(ar), multiple), _round_side(resolution / math.sqrt(ar), multiple))
        for ar in (ratios or _aspect_ratios(min_ar, max_ar, num_ar_buckets))
    }
    return sorted(sizes)


def size_bucket(width: int, height: int, frames: int | None, sizes: list[list[int]],
                multiple: int = SIDE_MULTIPLE) -> tuple[int, ...] | None:
    """``size_buckets``: the size whose aspect ratio is nearest the item's (log space) among those of its kind
    (a still: one frame; a clip: the most frames up to ``frames``), sides rounded to ``multiple``; None when no
    size of its kind exists."""
    def kind_fits(b):
        f = b[2] if len(b) == 3 else 1
        return f == 1 if frames is None else 1 < f <= frames
    fitting = [b for b in sizes if kind_fits(b)]
    if not fitting:
        return None
    log_ar = math.log(width / height)
    best_ar = min((abs(log_ar - math.log(b[0] / b[1])), b[0] / b[1]) for b in fitting)[1]
    same_ar = [b for b in fitting if b[0] / b[1] == best_ar]
    b = max(same_ar, key=lambda b: (b[2] if len(b) == 3 else 1, b[0] * b[1]))
    side = (_round_side(b[0], multiple), _round_side(b[1], multiple))
    return side if frames is None else (*side, b[2])


def assign_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest the image's, measured in log space (first wins ties)."""
    if not buckets:
        raise ValueError("assign_bucket needs at least one bucket")
    log_ar = math.log(width / height)
    return min(buckets, key=lambda b: abs(log_ar - math.log(b[0] / b[1])))


def check_frame_buckets(items: list[MediaItem], frame_multiple: int, size_buckets=None) -> None:
    """A video model whose clips must be ``frame_multiple`` k + 1 frames long (Wan: 4k + 1) rejects others: the
    size_buckets' frames where they are set (an item's directory's, else the top level's ``size_buckets``), else the
    items' frame buckets."""
    def sizes(item):
        return item.buckets.sizes if item.buckets is not None else size_buckets
    sized = [b for item in items for b in sizes(item) or ()] if items else list(size_buckets or ())
    bad = sorted({b[2] for b in sized if len(b) == 3 and (b[2] - 1) % frame_multiple})
    if bad:
        raise DatasetError(f"size_buckets frames {bad}: this model trains on clips of {frame_multiple}k + 1 "
                           "frames; change those size_buckets entries")
    bad = sorted({f for item in items if not sizes(item) for f in item.frame_buckets if (f - 1) % frame_multiple})
    if bad:
        fits = ", ".join(str(frame_multiple * k + 1) for k in range(5))
        raise DatasetError(f"frame_buckets {bad}: this model trains on clips of {frame_multiple}k + 1 frames "
                           f"({fits}, ...); change the dataset's frame_buckets")


def build_examples(cfg: DatasetConfig, items: list[MediaItem], model_fps: float | None = None,
                  side_multiple: int = SIDE_MULTIPLE) -> list[Example]:
    """One example per item and resolution, at the item's bucket; repeats are expanded later. A video (video
    models: ``model_fps`` set) trains as one clip: its bucket is (width, height, frames), the frames the
    largest of its frame buckets it fills at ``model_fps`` (see ``video.py``). Bucket sides are multiples of
    ``side_multiple`` (the model's ``spatial_multiple``)."""
    from .video import frame_bucket, frames_at_rate

    top = cfg.bucket_options(None)
    # (resolution, a directory's bucket keys) -> sizes; (width, height, resolution, bucket keys) -> the size
    buckets_by_resolution: dict[tuple, list[tuple[int, int]]] = {}
    assigned: dict[tuple, tuple[int, int]] = {}   # pictures of one shape share sizes
    examples, too_short, unsized = [], [], []
    for item in items:
        options = item.buckets or top
        if options.sizes:
            clip = frames_at_rate(item.frames, item.fps, model_fps) if item.frames > 1 and model_fps else None
            bucket = size_bucket(item.width, item.height, clip, [list(b) for b in options.sizes], side_multiple)
            if bucket is None:
                unsized.append(item)
            else:
                examples.append(Example(item=item, bucket=bucket))
            continue
        frames = None
        if item.frames > 1 and model_fps:
            frames = frame_bucket(frames_at_rate(item.frames, item.fps, model_fps), list(item.frame_buckets))
            if frames is None:
                too_short.append(item)
                continue
        for resolution in item.resolutions:
            sizes = (resolution, options)
            if sizes not in buckets_by_resolution:
                buckets_by_resolution[sizes] = make_buckets(
                    resolution, options.enabled, options.min_ar, options.max_ar, options.count, side_multiple,
                    None if options.ratios is None else list(options.ratios))
            size = (item.width, item.height, *sizes)
            if size not in assigned:
                assigned[size] = assign_bucket(item.width, item.height, buckets_by_resolution[sizes])
            bucket = assigned[size]
            examples.append(Example(item=item, bucket=bucket if frames is None else (*bucket, frames)))
    if unsized:
        log.warning("leaving out %d item(s) that no size bucket of their kind (stills: 1 frame, clips: up to "
                    "their length) takes:%s", len(unsized), "".join(f"\n  {i.path}" for i in unsized))
    if too_short:
        log.warning("leaving out %d video(s) shorter than every frame bucket above 1 at %g fps:%s", len(too_short),
                    model_fps, "".join(f"\n  {i.path}: {frames_at_rate(i.frames, i.fps, model_fps)} frames, "
                                       f"frame_buckets {list(i.frame_buckets)}" for i in too_short))
    return examples
