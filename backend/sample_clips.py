# SPDX-License-Identifier: GPL-3.0-or-later
"""Epoch samples of video models: clips saved as animated WebP, and the start image of i2v models.

A video model (one with a frame rate) renders each sample as a clip of ``[samples] frames`` frames, saved as
ComfyUI's SaveAnimatedWEBP saves one (Pillow, lossy at quality 80, method 4, each frame 1000 / fps ms). An i2v
model's clips start from ``[samples] start_image`` (wan_flf2v: it is the first frame, the end left free), or
else from the first frame of the dataset's first clip, by file name (wan_flf2v: its first and last frames), read
from the dataset file itself, not the cache, at the sample size.
"""
from __future__ import annotations

from pathlib import Path

from .config import RunConfig
from .errors import ConfigError

WEBP_QUALITY, WEBP_METHOD = 80, 4   # SaveAnimatedWEBP's defaults (lossless off, compression "default")


def is_video(adapter) -> bool:
    """Whether epoch samples of this adapter (class or instance) are clips: video models have a frame rate."""
    return adapter.framerate is not None


def image_problem(path: Path) -> str | None:
    """Why ``path`` is not a readable image file, or None."""
    from PIL import Image

    if not path.is_file():
        return f"{path} is not a file"
    try:
        with Image.open(path) as image:
            image.verify()
    except Exception as e:  # Pillow raises many types for files that are no image
        return f"{path} is not a readable image ({type(e).__name__})"
    return None


def check_samples(cfg: RunConfig) -> None:
    """``[samples]`` against the model type: a clip length the VAE can compress, a start image only for i2v types
    and only a readable image file."""
    from .models.registry import ADAPTERS, adapter_class

    s, adapter = cfg.samples, adapter_class(cfg.model.type)
    if s is None:
        return
    if is_video(adapter) and (s.frames - 1) % adapter.frame_multiple:
        m = adapter.frame_multiple
        raise ConfigError(f"got {s.frames}; {cfg.model.type} clips are {m}k + 1 frames long, e.g. "
                          f"{(s.frames - 1) // m * m + 1} or {(s.frames - 1) // m * m + m + 1}", file=cfg.file,
                          key="samples.frames")
    if s.start_image is None:
        return
    if not adapter.takes_start_image:
        takers = sorted(name for name in ADAPTERS if adapter_class(name).takes_start_image)
        raise ConfigError(f"a {cfg.model.type} model samples without a start image; only the image-to-video types "
                          f"take one ({', '.join(takers)}): leave samples.start_image out", file=cfg.file,
                          key="samples.start_image")
    problem = image_problem(cfg.resolve(s.start_image))
    if problem:
        raise ConfigError(f"{problem}; name an image file (relative to the run config, or absolute)", file=cfg.file,
                          key="samples.start_image")


def start_images(cfg: RunConfig, adapter) -> list:
    """An i2v model's conditioning images [1, H, W, 3] at the sample size: ``start_image``, else the dataset's
    first clip's first frame (wan_flf2v: and its last)."""
    from .data import load_pixels, scan_dataset

    s, size = cfg.samples, (cfg.samples.width, cfg.samples.height)
    if s.start_image is not None:
        check_samples(cfg)   # the file may have changed since the run was queued
        return [load_pixels(cfg.resolve(s.start_image), size)[None]]
    clips = sorted((item.path for item in scan_dataset(cfg.dataset_config, videos=True).items if item.frames > 1))
    if not clips:
        raise ConfigError(f"{cfg.model.type} samples start from an image and the dataset has no clip to take its "
                          "first frame from: set samples.start_image (Samples node start_image)", file=cfg.file,
                          key="samples.start_image")
    return clip_ends(clips[0], size, both=getattr(adapter, "given_last_frame", False))


def clip_ends(path: Path, size: tuple[int, int], both: bool = False) -> list:
    """The first frame of a clip (``both``: and its last), each [1, H, W, 3] covering ``size`` as training crops."""
    import numpy as np
    import torch

    from .data.pixels import _cover_and_center_crop
    from .data.video import _timed_frames

    first = last = None
    for _, frame in _timed_frames(path):
        first = frame if first is None else first
        last = frame
        if not both:
            break
    frames = [first, last] if both else [first]
    return [torch.from_numpy(np.array(_cover_and_center_crop(f.convert("RGB"), *size), dtype=np.float32)
                             ).div_(255.0)[None] for f in frames]


def save_clip(pixels, path: Path, fps: float) -> None:
    """Frames [F, H, W, 3] in 0..1 as an animated WebP, the way ComfyUI's SaveAnimatedWEBP writes one."""
    import numpy as np
    from PIL import Image

    frames = [Image.fromarray(f) for f in (pixels.clamp(0, 1).cpu().float().numpy() * 255).round().astype(np.uint8)]
    frames[0].save(path, format="WEBP", save_all=True, append_images=frames[1:], duration=int(1000.0 / fps),
                   lossless=False, quality=WEBP_QUALITY, method=WEBP_METHOD)
