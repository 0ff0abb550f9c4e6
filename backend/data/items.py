"""The two records the data room hands to the rest of the backend: a media file and a training example."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import BucketOptions, CaptionOptions


@dataclass(frozen=True)
class MediaItem:
    """One readable image in the dataset, with the settings of the [[directory]] it came from."""

    path: Path  # absolute
    caption: str  # '' when the caption file is missing
    width: int  # original size in pixels, after EXIF orientation
    height: int
    num_repeats: int
    resolutions: tuple[int, ...]
    captions: CaptionOptions = CaptionOptions()  # prefix / tag shuffling of its directory
    frames: int = 1       # a video's source frames (1: an image)
    fps: float = 0.0      # a video's source frame rate
    frame_buckets: tuple[int, ...] = (1,)  # its directory's frame buckets (video models)
    buckets: BucketOptions | None = None   # its directory's bucket keys (the top level's where it sets none)
    control: Path | None = None  # edit models: the paired control image (same stem, the directory's control_path)
    more_controls: tuple[Path, ...] = ()  # multi-reference edit models: the images of the further control folders
    mask: Path | None = None     # masked training: its mask image (same stem in mask_path, or default_mask_file)
    control_mask: Path | None = None   # wan_vace: its control mask (control_mask_path)
    reference: Path | None = None      # wan_vace: its reference image (reference_path)
    is_reg: bool = False  # from an is_reg directory: a regularisation image
    seconds: float = 0.0  # an audio file's duration (audio models)
    lyrics: str = ""      # an audio file's lyrics (its .lyrics.txt; audio models)
    more_captions: tuple[str, ...] = ()   # captions.json's further captions of the file: each its own example

    @property
    def controls(self) -> tuple[Path, ...]:
        return () if self.control is None else (self.control, *self.more_controls)


@dataclass(frozen=True)
class Example:
    """One training example: an item at one bucket size (pixels, multiples of 16)."""

    item: MediaItem
    bucket: tuple[int, ...]  # (width, height) for an image, (width, height, frames) for a video clip
    caption: str | None = None  # the text trained on (prefix, shuffled variant); None: item.caption as is

    @property
    def text(self) -> str:
        return self.item.caption if self.caption is None else self.caption
