"""Videos for video models: what a file holds (size, frames, frame rate) and the frames a clip trains on.

- Reading: containers (mp4, mov, mkv, webm, avi, m4v, gif) through PyAV (FFmpeg; ComfyUI's own video
  dependency), animated WebP through Pillow (FFmpeg cannot decode animated WebP). A file with one frame is
  an image.
- Frame rate: a clip is resampled to the model's frame rate (Wan: 16 fps). Model frame k shows the source
  frame on screen at time k / fps after the first frame (frames are repeated when the source is slower,
  skipped when it is faster), so motion keeps its real speed whatever the source rate.
- Frame buckets: a video trains as one clip from its start, of the largest ``frame_buckets`` entry that
  its resampled length fills; a video shorter than every entry above 1 is left out and reported.
- Each frame is scaled and centre-cropped to the aspect-ratio bucket like an image.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from PIL import Image

from ..errors import DatasetError

if TYPE_CHECKING:
    import torch

CONTAINER_EXTENSIONS = {".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".gif"}
PILLOW_ANIMATED_EXTENSIONS = {".webp"}
VIDEO_PREPROCESS_VERSION = "1"   # bump whenever load_video returns different frames for the same file


@dataclass(frozen=True)
class VideoInfo:
    width: int
    height: int
    frames: int        # source frames
    fps: float         # source frames per second (over the span first -> last frame)


def may_be_video(path: Path) -> bool:
    return path.suffix.lower() in CONTAINER_EXTENSIONS | PILLOW_ANIMATED_EXTENSIONS


def _container_timestamps(path: Path) -> tuple[int, int, list[float]]:
    import av
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        base = float(stream.time_base) if stream.time_base else 0.0
        times = sorted(float(p.pts) * base for p in container.demux(stream) if p.size and p.pts is not None)
        if not times:  # no timestamps in the container: count decoded frames at its nominal rate
            rate = float(stream.average_rate or stream.guessed_rate or 1)
            container.seek(0)
            times = [i / rate for i, _ in enumerate(container.decode(stream))]
    return width, height, times


def _pillow_frames(image: Image.Image) -> Iterator[tuple[float, Image.Image]]:
    """(seconds, frame) of every frame of an animated Pillow image."""
    elapsed = 0.0
    for i in range(getattr(image, "n_frames", 1)):
        image.seek(i)
        image.load()
        stamp = image.info.get("timestamp")
        yield (stamp / 1000.0 if stamp is not None else elapsed), image
        elapsed += image.info.get("duration", 0) / 1000.0


def probe_video(path: Path) -> VideoInfo | None:
    """The video's size, frame count and rate; None when the file has a single frame (an image).
    Raises ``DatasetError`` naming the file when it cannot be read."""
    try:
        if path.suffix.lower() in PILLOW_ANIMATED_EXTENSIONS:
            with Image.open(path) as image:
                if getattr(image, "n_frames", 1) < 2:
                    return None
                width, height = image.size
                times = [t for t, _ in _pillow_frames(image)]
        else:
            width, height, times = _container_timestamps(path)
    except Exception as e:  # PyAV and Pillow raise many types for bad files
        raise DatasetError(f"{path}: cannot read the video ({type(e).__name__}: {e})") from e
    if len(times) < 2:
        return None
    span = times[-1] - times[0]
    fps = (len(times) - 1) / span if span > 0 else 1.0
    return VideoInfo(width, height, len(times), fps)


def frames_at_rate(frames: int, fps: float, model_fps: float) -> int:
    """How many frames a video of ``frames`` source frames at ``fps`` gives at ``model_fps``."""
    if frames <= 1:
        return frames
    return math.floor((frames - 1) / fps * model_fps + 1e-6) + 1


def frame_bucket(available: int, buckets: list[int]) -> int | None:
    """The largest frame bucket above 1 that ``available`` frames fill (None: too short for all)."""
    fits = [f for f in buckets if 1 < f <= available]
    return max(fits) if fits else None


def _timed_frames(path: Path) -> Iterator[tuple[float, Image.Image]]:
    if path.suffix.lower() in PILLOW_ANIMATED_EXTENSIONS:
        with Image.open(path) as image:
            for t, frame in _pillow_frames(image):
                yield t, frame.convert("RGB")
        return
    import av
    with av.open(str(path)) as container:
        for i, frame in enumerate(container.decode(video=0)):
            yield (frame.time if frame.time is not None else float(i)), frame.to_image()


def _select(timed: Iterator[tuple[float, Image.Image]], count: int, model_fps: float) -> list[Image.Image]:
    """``count`` frames at ``model_fps``: frame k is the last source frame at or before k / model_fps."""
    out, previous, start = [], None, None
    for t, frame in timed:
        start = t if start is None else start
        while previous is not None and len(out) < count and t > start + len(out) / model_fps + 1e-6:
            out.append(previous)
        if len(out) == count:
            break
        previous = frame
    while previous is not None and len(out) < count:
        out.append(previous)
    return out


def load_video(path: Path, bucket: tuple[int, int, int], model_fps: float) -> "torch.Tensor":
    """RGB float32 frames [F, H, W, 3] in 0..1 for a (width, height, frames) bucket."""
    import numpy as np
    import torch

    from .pixels import _cover_and_center_crop

    width, height, count = bucket
    try:
        frames = _select(_timed_frames(path), count, model_fps)
        frames = [np.array(_cover_and_center_crop(f.convert("RGB"), width, height), dtype=np.float32)
                  for f in frames]
    except Exception as e:  # PyAV and Pillow raise many types for bad files
        raise DatasetError(f"{path}: cannot read the video ({type(e).__name__}: {e}); "
                           "remove the file or replace it with a readable one") from e
    if len(frames) < count:
        raise DatasetError(f"{path}: has {len(frames)} frames, the {count}-frame bucket needs more; "
                           "the file changed since it was scanned: run again")
    return torch.from_numpy(np.stack(frames)).div_(255.0)
