"""Checks and helpers that several config sections share."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from ..errors import ConfigError
from .process_inputs import shown

MAX_RESOLUTION = 8192   # a side of 8192 is 64 Mpx a frame already; larger values are typos that exhaust memory


def check_resolutions(resolutions: list[int], file, key: str) -> None:
    """Square sides in pixels (a [width, height] pair arrives here as the side of the same area)."""
    if not resolutions or any(r < 64 or r % 16 or r > MAX_RESOLUTION for r in resolutions):
        raise ConfigError(f"got {resolutions}; each resolution must be a multiple of 16 from 64 to {MAX_RESOLUTION}",
                          file=file, key=key)


def config_path(base: Path | None, value: str | Path) -> Path:
    """A path a config file names: absolute as given; relative, from ``base`` (the folder of the file that names
    it), or from the working directory where only that holds it: diffusion-pipe reads every relative path from
    the working directory (its examples name ``examples/dataset.toml`` from its repository's root), and such a
    config runs unchanged where it would run there, while ours keep working from any folder."""
    p = Path(value).expanduser()
    if p.is_absolute() or base is None:
        return p
    here = base / p
    if not here.exists() and (Path.cwd() / p).exists():
        return Path.cwd() / p
    return here


def check_folder(value: str, file, key: str) -> None:
    """A folder PipeTrain writes into: it, or the nearest part of its path that exists, must be a folder."""
    path = config_path(Path(file).parent if file is not None else None, value)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                raise ConfigError(f"{part} is a file, not a folder; name a folder to write into (it is created if "
                                  "missing)", file=file, key=key)
            return


def check_frame_buckets(buckets: list[int], file, key: str) -> None:
    if not buckets or any(f < 1 for f in buckets):
        raise ConfigError(f"got {buckets}; give frame counts of 1 or more, e.g. [1, 17, 33]", file=file, key=key)


def check_caption_extension(extension: str | None, file, key: str) -> None:
    """A file name ending, never a path: the caption is read from ``<folder>/<stem><extension>``, and
    ``/../../x`` would read a file outside the dataset."""
    if extension is not None and not re.fullmatch(r"\.?[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*", extension):
        raise ConfigError(f"got {shown(extension)}; a file extension such as .txt (letters, digits, '_', '-', '.')",
                          file=file, key=key)



def replace(cfg, **changes):
    """``dataclasses.replace`` that keeps what loading attached (the source file, the loaded dataset)."""
    new = dataclasses.replace(cfg, **changes)
    for name in ("_dataset", "_evals", "_file", "_base"):
        if hasattr(cfg, name):
            setattr(new, name, getattr(cfg, name))
    return new
