"""The dataset file: ``[[directory]]`` tables and the settings shared by them (diffusion-pipe's keys)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

from . import compat
from ..errors import ConfigError
from .common import (MAX_RESOLUTION, check_caption_extension, check_frame_buckets, check_resolutions, config_path,
                     replace)

@dataclass
class DirectoryConfig:
    """One [[directory]]; unset keys take the dataset file's top-level value."""
    path: str
    num_repeats: Optional[int] = None
    resolutions: Optional[list[int]] = None
    caption_extension: Optional[str] = None
    caption_prefix: Optional[str] = None
    shuffle_tags: Optional[bool] = None
    cache_shuffle_num: Optional[int] = None
    cache_shuffle_delimiter: Optional[str] = None
    skip_empty_caption: Optional[bool] = None
    frame_buckets: Optional[list[int]] = None   # video models: clip lengths in frames (see DatasetConfig)
    # bucket keys (see DatasetConfig); diffusion-pipe's per-directory values over the top level's
    enable_ar_bucket: Optional[bool] = None
    min_ar: Optional[float] = None
    max_ar: Optional[float] = None
    num_ar_buckets: Optional[int] = None
    ar_buckets: Optional[list[float]] = None
    size_buckets: Optional[list[list[int]]] = None
    # edit models: control images paired by file stem; a list of folders gives each image several (Qwen-Image-Edit
    # 2509, Flux 2 edit: one reference each, in the list's order; ai-toolkit's list form of the key)
    control_path: Union[str, list[str], None] = None
    # masked training (diffusion-pipe's keys): a mask image per training image (same file stem), its red channel
    # the loss weight of each pixel (white 1, black 0); default_mask_file for images without one
    mask_path: Optional[str] = None
    default_mask_file: Optional[str] = None
    # wan_vace: WanVaceToVideo's control_masks (a folder of mask videos / images paired by stem, white = the
    # region to generate) and reference_image (a folder of images paired by stem, or one image for every file)
    control_mask_path: Optional[str] = None
    reference_path: Optional[str] = None
    # regularisation (prior-preservation) images: drawn into each epoch at the dataset's reg_ratio, their loss
    # logged apart (train/loss_reg); ai-toolkit's key
    is_reg: bool = False

    UNSUPPORTED = compat.DIRECTORY
    preprocess = classmethod(lambda cls, data, file, prefix: compat.preprocess_dataset(data, file, prefix))

    def validate(self, file):
        if self.num_repeats is not None and self.num_repeats < 1:
            raise ConfigError(f"got {self.num_repeats}; must be 1 or more", file=file, key="directory.num_repeats")
        if self.cache_shuffle_num is not None and self.cache_shuffle_num < 0:
            raise ConfigError("must be 0 or more", file=file, key="directory.cache_shuffle_num")
        if self.frame_buckets is not None:
            check_frame_buckets(self.frame_buckets, file, "directory.frame_buckets")
        check_caption_extension(self.caption_extension, file, "directory.caption_extension")
        if isinstance(self.control_path, list) and not self.control_path:
            raise ConfigError("an empty list: give a folder of control images (or several in a list), or remove the "
                              "key", file=file, key="directory.control_path")
        if self.resolutions is not None:
            check_resolutions(self.resolutions, file, "directory.resolutions")


_ASPECT_KEYS = ("min_ar", "max_ar", "num_ar_buckets", "ar_buckets")


def check_aspect_buckets(a: BucketOptions, file, prefix: str, given: list[str]) -> None:
    """The aspect-ratio keys of one table (``prefix``: 'directory[i].' or ''), checked at the values that table trains
    with; only ``given`` keys (those the table sets) are checked, so a directory is not blamed for the top level."""
    if ({"min_ar", "max_ar"} & set(given)) and not 0 < a.min_ar <= 1 <= a.max_ar:
        raise ConfigError(f"got min_ar={a.min_ar}, max_ar={a.max_ar}; need 0 < min_ar <= 1 <= max_ar",
                          file=file, key=prefix + ("min_ar" if "min_ar" in given else "max_ar"))
    if "num_ar_buckets" in given and a.count < 1:
        raise ConfigError("must be 1 or more", file=file, key=prefix + "num_ar_buckets")
    if "ar_buckets" in given and a.ratios is not None and (not a.ratios or any(not 0.05 <= r <= 20 for r in a.ratios)):
        raise ConfigError(f"got {list(a.ratios)}; give aspect ratios (width / height) from 0.05 to 20, or "
                          "[width, height] pairs, e.g. [0.75, 1.0, [1216, 832]]", file=file, key=prefix + "ar_buckets")


def control_folders(d: DirectoryConfig) -> list[str]:
    """``control_path`` as a list: [] when unset, one entry for a single folder."""
    return [] if d.control_path is None else [d.control_path] if isinstance(d.control_path, str) else d.control_path


def check_size_buckets(buckets: list, file, prefix: str = "") -> None:
    for i, b in enumerate(buckets):
        if not isinstance(b, list) or len(b) not in (2, 3) or not all(isinstance(v, int) for v in b) \
                or not all(64 <= v <= MAX_RESOLUTION and v % 16 == 0 for v in b[:2]) or (len(b) == 3 and b[2] < 1):
            raise ConfigError(f"entry {b!r}: give [width, height] or [width, height, frames], sides multiples of 16 "
                              f"from 64 to {MAX_RESOLUTION}, frames 1 or more", file=file,
                              key=f"{prefix}size_buckets[{i}]")
    if not buckets:
        raise ConfigError("give at least one [width, height] (or leave size_buckets out)", file=file,
                          key=f"{prefix}size_buckets")


@dataclass(frozen=True)
class BucketOptions:
    """One directory's bucket keys: exact ``sizes`` (``size_buckets``) where given; else aspect-ratio buckets,
    ``ratios`` (``ar_buckets``) where given, else ``count`` ratios from ``min_ar`` to ``max_ar``; ``enabled``
    false: one square bucket."""
    enabled: bool = False
    min_ar: float = 0.5
    max_ar: float = 2.0
    count: int = 7
    ratios: Optional[tuple[float, ...]] = None
    sizes: Optional[tuple[tuple[int, ...], ...]] = None


@dataclass(frozen=True)
class CaptionOptions:
    """How one directory's captions become the texts that are encoded and trained on."""
    prefix: str = ""
    shuffle_num: int = 0          # shuffled variants per caption, each its own example (0: the caption as is)
    delimiter: str = ", "
    skip_empty: bool = False


@dataclass
class DatasetConfig:
    directory: list[DirectoryConfig]
    resolutions: list[int] = field(default_factory=lambda: [512])
    enable_ar_bucket: bool = False
    min_ar: float = 0.5
    max_ar: float = 2.0
    num_ar_buckets: int = 7
    # diffusion-pipe's explicit buckets: aspect ratios (width / height; [w, h] pairs become w / h) instead of
    # min_ar..max_ar, or exact sizes [w, h] / [w, h, frames] instead of resolutions and ratios altogether
    ar_buckets: Optional[list[float]] = None
    size_buckets: Optional[list[list[int]]] = None
    num_repeats: int = 1
    caption_extension: str = ".txt"
    on_unreadable: Literal["skip", "error"] = "skip"
    caption_prefix: str = ""               # prepended to every caption (outside any shuffling)
    shuffle_tags: bool = False             # true alone = cache_shuffle_num 1 (one shuffled variant)
    cache_shuffle_num: int = 0             # N shuffled variants of each caption, each its own example
    cache_shuffle_delimiter: str = ", "
    skip_empty_caption: bool = False       # true: leave out images without a caption (else: empty caption)
    # video models: each video trains as one clip of the largest of these frame counts it fills at the
    # model's frame rate, taken from its start (1 = still images; a video never goes to 1)
    frame_buckets: list[int] = field(default_factory=lambda: [1])
    # with is_reg directories: the share of each epoch's samples drawn from them (the rest: every training sample)
    reg_ratio: float = 0.5
    # diffusion-pipe's: keep int(global batches x ratio) of each epoch's global batches (EpochPlan); None: all
    subsample_ratio: Optional[float] = None
    # where relative directory paths are resolved; set from the file's location, not written back
    _base: Optional[Path] = None

    UNSUPPORTED = compat.DATASET
    preprocess = classmethod(lambda cls, data, file, prefix: compat.preprocess_dataset(data, file, prefix))

    def validate(self, file):
        if not self.directory:
            raise ConfigError("at least one [[directory]] is required", file=file, key="directory")
        check_resolutions(self.resolutions, file, "resolutions")
        check_aspect_buckets(self.bucket_options(None), file, "", list(_ASPECT_KEYS))
        for i, d in enumerate(self.directory):
            check_aspect_buckets(self.bucket_options(d), file, f"directory[{i}].",
                                 [k for k in _ASPECT_KEYS if getattr(d, k) is not None])
            if d.size_buckets is not None:
                check_size_buckets(d.size_buckets, file, f"directory[{i}].")
        if self.size_buckets is not None:
            check_size_buckets(self.size_buckets, file)
        if self.num_repeats < 1:
            raise ConfigError("must be 1 or more", file=file, key="num_repeats")
        if self.cache_shuffle_num < 0:
            raise ConfigError("must be 0 or more", file=file, key="cache_shuffle_num")
        check_frame_buckets(self.frame_buckets, file, "frame_buckets")
        check_caption_extension(self.caption_extension, file, "caption_extension")
        if not 0 < self.reg_ratio < 1:
            raise ConfigError(f"got {self.reg_ratio}; must be between 0 and 1, e.g. 0.5: half of each epoch's "
                              "samples from the is_reg directories", file=file, key="reg_ratio")
        if self.subsample_ratio is not None and not 0 < self.subsample_ratio <= 1:
            raise ConfigError(f"got {self.subsample_ratio}; give the share of each epoch to train, above 0 and at "
                              "most 1 (e.g. 0.5: half of its batches), or remove the key to train on all of it",
                              file=file, key="subsample_ratio")
        if all(d.is_reg for d in self.directory):
            raise ConfigError("every [[directory]] is marked is_reg: regularisation images go beside the training "
                              "images; set is_reg = false on the directory of the images to learn", file=file,
                              key="directory.is_reg")

    def caption_options(self, d: DirectoryConfig) -> CaptionOptions:
        def pick(name):
            value = getattr(d, name)
            return getattr(self, name) if value is None else value
        shuffle_num = pick("cache_shuffle_num")
        if shuffle_num == 0 and pick("shuffle_tags"):
            shuffle_num = 1
        return CaptionOptions(prefix=pick("caption_prefix"), shuffle_num=shuffle_num,
                              delimiter=pick("cache_shuffle_delimiter"), skip_empty=pick("skip_empty_caption"))

    def bucket_options(self, d: DirectoryConfig | None) -> BucketOptions:
        """Directory ``d``'s bucket keys (None: the top level's), each the directory's where it sets it, as
        diffusion-pipe reads them: size_buckets win over the rest, ar_buckets over min_ar..max_ar (each the
        directory's, else the top level's)."""
        def pick(name):
            value = None if d is None else getattr(d, name)
            return getattr(self, name) if value is None else value
        ratios, sizes = pick("ar_buckets"), pick("size_buckets")
        return BucketOptions(enabled=pick("enable_ar_bucket"), min_ar=pick("min_ar"), max_ar=pick("max_ar"),
                             count=pick("num_ar_buckets"), ratios=None if ratios is None else tuple(ratios),
                             sizes=None if sizes is None else tuple(tuple(b) for b in sizes))

    def with_absolute_paths(self) -> "DatasetConfig":
        dirs = [dataclasses.replace(d, path=str(self.directory_path(d).resolve()),
                                    **{k: str(getattr(self, k)(d).resolve()) for k in (
                                        "mask_path", "default_mask_file", "control_mask_path", "reference_path")
                                       if getattr(d, k) is not None})
                for d in self.directory]
        return replace(self, directory=dirs)

    def directory_path(self, d: DirectoryConfig) -> Path:
        return self._relative(d.path)

    def control_paths(self, d: DirectoryConfig) -> list[Path]:
        """The directory's control folders, in order (none, one, or several for multi-reference edit models)."""
        return [self._relative(p) for p in control_folders(d)]

    def mask_path(self, d: DirectoryConfig) -> Path | None:
        return None if d.mask_path is None else self._relative(d.mask_path)

    def default_mask_file(self, d: DirectoryConfig) -> Path | None:
        return None if d.default_mask_file is None else self._relative(d.default_mask_file)

    def control_mask_path(self, d: DirectoryConfig) -> Path | None:
        return None if d.control_mask_path is None else self._relative(d.control_mask_path)

    def reference_path(self, d: DirectoryConfig) -> Path | None:
        return None if d.reference_path is None else self._relative(d.reference_path)

    def _relative(self, path: str) -> Path:
        return config_path(self._base, path)


