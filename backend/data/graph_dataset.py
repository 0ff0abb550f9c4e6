# SPDX-License-Identifier: GPL-3.0-or-later
"""Images made in a ComfyUI graph, written as a dataset folder a Dataset node (or a run config) can train on.

The folder is content-addressed: its name ends in a digest of every image's pixels and caption, so the same
images and captions always give the same folder (queued again, nothing is rewritten and the latent cache still
matches), and different ones never overwrite a folder a run may be reading. Each image is a PNG named by its own
digest, its caption beside it in a ``.txt`` of the same name. The folder is filled under a temporary name and
renamed into place, so a reader never sees half of it.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import numpy as np

MAX_IMAGES = 10_000
MAX_SIDE = 8192
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
COMPLETE = ".complete"    # written last: a folder without it was interrupted and is rebuilt


def check_inputs(images: np.ndarray, captions: list[str], name: str) -> None:
    """Refuses what cannot make a dataset, naming the input: ``images`` [N, H, W, 3] uint8, ``captions`` one per
    image or one for all, ``name`` a plain folder-name prefix."""
    if not NAME.match(name):
        raise ValueError(f"name {name!r}: use letters, digits, '-' and '_' (at most 64, starting with a letter or "
                         "digit); it becomes the start of the dataset folder's name")
    if images.ndim != 4 or images.shape[-1] not in (3, 4) or images.dtype != np.uint8:
        raise ValueError(f"images: expected a batch of RGB images, got an array of shape {tuple(images.shape)}")
    n, h, w = images.shape[:3]
    if not 1 <= n <= MAX_IMAGES:
        raise ValueError(f"images: {n} images; a graph-built dataset holds 1 to {MAX_IMAGES}")
    if not (16 <= h <= MAX_SIDE and 16 <= w <= MAX_SIDE):
        raise ValueError(f"images: {w}x{h} pixels; each side must be 16 to {MAX_SIDE}")
    if len(captions) not in (1, n):
        raise ValueError(f"captions: {len(captions)} lines for {n} images; give one caption per image (one per "
                         "line, in the batch's order) or a single caption for all")


def split_captions(text: str) -> list[str]:
    """One caption per non-empty line; no lines at all: one empty caption for every image."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines or [""]


def _digest(pixels: np.ndarray, caption: str) -> str:
    h = hashlib.sha256()
    h.update(repr(pixels.shape).encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    h.update(b"\0" + caption.encode())
    return h.hexdigest()


def write_dataset(images: np.ndarray, captions: list[str], root: Path, name: str = "graph") -> Path:
    """The dataset folder under ``root`` holding ``images`` with ``captions``; written once per content."""
    from PIL import Image

    check_inputs(images, captions, name)
    rgb = images[..., :3]
    per_image = captions if len(captions) == len(rgb) else captions * len(rgb)
    digests = [_digest(img, cap) for img, cap in zip(rgb, per_image)]
    folder = Path(root) / f"{name}-{hashlib.sha256(''.join(digests).encode()).hexdigest()[:16]}"
    if (folder / COMPLETE).exists():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(root) / f".{folder.name}.{os.getpid()}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        for img, cap, digest in zip(rgb, per_image, digests):
            stem = digest[:16]
            Image.fromarray(img).save(staging / f"{stem}.png")
            (staging / f"{stem}.txt").write_text(cap, encoding="utf-8")
        (staging / COMPLETE).write_text(f"{len(rgb)} images\n")
        if folder.exists():           # an interrupted earlier write, or one finished meanwhile by another queue
            if (folder / COMPLETE).exists():
                return folder
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
