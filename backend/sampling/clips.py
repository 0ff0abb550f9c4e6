# SPDX-License-Identifier: GPL-3.0-or-later
"""Epoch samples of video models: clips saved as animated WebP, and the start image of i2v models.

A video model (one with a frame rate) renders each sample as a clip of ``[samples] frames`` frames, saved as
ComfyUI's SaveAnimatedWEBP saves one (Pillow, lossy at quality 80, method 4, each frame 1000 / fps ms). An i2v
model's clips start from ``[samples] start_image`` (wan_flf2v: it is the first frame, the end left free unless
``[samples] end_image`` names the last), or else from the first frame of the dataset's first clip, by file name
(wan_flf2v: its first and last frames, ``end_image`` replacing the last), read from the dataset file itself, not
the cache, at the sample size. Control-video models' clips: ``sampling/controls.py``.
"""
from __future__ import annotations

from pathlib import Path

from ..config import RunConfig
from ..errors import ConfigError

WEBP_QUALITY, WEBP_METHOD = 80, 4   # SaveAnimatedWEBP's defaults (lossless off, compression "default")


def is_video(adapter) -> bool:
    """Whether epoch samples of this adapter (class or instance) are clips: video models have a frame rate."""
    return adapter.framerate is not None


def image_problem(path: Path, whole: bool = True) -> str | None:
    """Why ``path`` is not a readable image file, or None; ``whole=False``: only its header is read (Pillow tells
    the format and size from it), not every chunk of it."""
    from PIL import Image

    if not path.is_file():   # a folder, a FIFO or a device: not opened
        return f"{path} is not a file"
    try:
        with Image.open(path) as image:
            if whole:
                image.verify()
    except Exception as e:  # Pillow raises many types for files that are no image
        return f"{path} is not a readable image ({type(e).__name__})"
    return None


def media_problem(path: Path, whole: bool = True) -> str | None:
    """Why ``path`` is neither a readable image nor a readable video (PyAV, or an animated WebP), or None;
    ``whole=False``: only headers are read (an image's, or the container's streams as PyAV opens it), not every
    frame."""
    from ..data.video import probe_video
    from ..errors import DatasetError

    problem = image_problem(path, whole)
    if problem is None or not path.is_file():
        return problem
    if not whole:
        return None if _has_video_stream(path) else f"{path} is not a readable video or image"
    try:
        readable = probe_video(path) is not None
    except DatasetError:
        readable = False
    return None if readable else f"{path} is not a readable video or image"


def _has_video_stream(path: Path) -> bool:
    """PyAV opens the file as a container with a video stream: its header and the first megabytes it probes."""
    import av
    try:
        with av.open(str(path)) as container:
            return bool(container.streams.video)
    except Exception:  # noqa: BLE001  (PyAV raises many types for files that are no video)
        return False


def check_samples(cfg: RunConfig) -> None:
    """``[samples]`` against the model type: a clip length the VAE can compress, a start image only for i2v types
    (not for wan_fun_control without its start image), an end image only for wan_flf2v, each a readable image
    file."""
    from ..models.registry import adapter_class

    s, adapter = cfg.samples, adapter_class(cfg.model.type)
    if s is None:
        return
    if is_video(adapter) and (s.frames - 1) % adapter.frame_multiple:
        m = adapter.frame_multiple
        raise ConfigError(f"got {s.frames}; {cfg.model.type} clips are {m}k + 1 frames long, e.g. "
                          f"{(s.frames - 1) // m * m + 1} or {(s.frames - 1) // m * m + m + 1}", file=cfg.file,
                          key="samples.frames")
    if s.start_image is not None:
        _check_image(cfg, "start_image", adapter.takes_start_image, "takes_start_image",
                     "a start image; only the image-to-video types")
        if adapter.takes_control_start_image and cfg.model.control_start_image is False:
            raise ConfigError(f"[model] control_start_image = false trains {cfg.model.type} without a start image, so "
                              "its samples take none: leave samples.start_image out", file=cfg.file,
                              key="samples.start_image")
    if s.end_image is not None:
        _check_image(cfg, "end_image", getattr(adapter, "given_last_frame", False), "given_last_frame",
                     "an end image; only the first-last-frame types")
    if s.control_video is not None:
        _check_image(cfg, "control_video", adapter.video_control, "video_control",
                     "a control video; only the control-video types", media_problem)


def _check_image(cfg: RunConfig, key: str, taken: bool, fact: str, takers: str, problem=image_problem) -> None:
    """``[samples] key`` names a readable image (``problem``: or what else it checks), and the model type takes
    one (its adapter's ``fact``; ``takers``: what it lacks and which types have it, in words)."""
    from ..models.registry import types_with

    if not taken:
        raise ConfigError(f"a {cfg.model.type} model samples without {takers} take one "
                          f"({', '.join(types_with(fact))}): leave "
                          f"samples.{key} out", file=cfg.file, key=f"samples.{key}")
    why = problem(cfg.resolve(getattr(cfg.samples, key)))
    if why:
        kind = "an image" if problem is image_problem else "a video or image"
        raise ConfigError(f"{why}; name {kind} file (relative to the run config, or absolute)", file=cfg.file,
                          key=f"samples.{key}")


def start_images(cfg: RunConfig, adapter, clip: Path | None = None) -> list:
    """An i2v model's conditioning images [1, H, W, 3] at the sample size: ``start_image``, else the first frame of
    ``clip`` (by default the dataset's first clip); wan_flf2v: then ``end_image``, else that clip's last frame (with
    a ``start_image`` and no ``end_image``: none, the end left free)."""
    from ..data import load_pixels

    s, size = cfg.samples, (cfg.samples.width, cfg.samples.height)
    if s.start_image is not None or s.end_image is not None:
        check_samples(cfg)   # the files may have changed since the run was queued
    if s.start_image is not None:
        images = [load_pixels(cfg.resolve(s.start_image), size)[None]]
    else:
        ends = getattr(adapter, "given_last_frame", False) and s.end_image is None
        images = clip_ends(clip or first_clip(cfg), size, both=ends)
    if s.end_image is not None:
        images = [images[0], load_pixels(cfg.resolve(s.end_image), size)[None]]
    return images


def first_clip(cfg: RunConfig) -> Path:
    """The dataset's first clip by file name (i2v samples take their start frame from it)."""
    from ..data import scan_dataset

    clips = sorted((item.path for item in scan_dataset(cfg.dataset_config, videos=True).items if item.frames > 1))
    if not clips:
        raise ConfigError(f"{cfg.model.type} samples start from an image and the dataset has no clip to take its "
                          "first frame from: set samples.start_image (Samples node start_image)", file=cfg.file,
                          key="samples.start_image")
    return clips[0]


def clip_ends(path: Path, size: tuple[int, int], both: bool = False) -> list:
    """The first frame of a clip (``both``: and its last), each [1, H, W, 3] covering ``size`` as training crops."""
    import numpy as np
    import torch

    from ..data.pixels import _cover_and_center_crop
    from ..data.video import _timed_frames

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
