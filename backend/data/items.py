"""The two records the data room hands to the rest of the backend: a media file and a training sample."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MediaItem:
    """One readable image in the dataset, with the settings of the [[directory]] it came from."""

    path: Path  # absolute
    caption: str  # '' when the caption file is missing
    width: int  # original size in pixels, after EXIF orientation
    height: int
    num_repeats: int
    resolutions: tuple[int, ...]


@dataclass(frozen=True)
class Sample:
    """One training example: an item at one bucket size (pixels, multiples of 16)."""

    item: MediaItem
    bucket: tuple[int, int]  # (width, height)
