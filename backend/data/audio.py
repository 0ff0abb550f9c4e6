# SPDX-License-Identifier: GPL-3.0-or-later
"""Audio datasets (ACE-Step): audio files with a tags caption and optional lyrics, bucketed by duration.

A dataset directory holds ``song.wav`` (or .flac, .mp3, .ogg, .m4a, .opus: whatever ComfyUI's ``LoadAudio`` decodes,
through the same PyAV reader), ``song.txt`` with its tags (the directory's caption extension) and optionally
``song.lyrics.txt`` with its lyrics (ComfyUI's lyrics format: one line each, ``[verse]`` style section tags, a
``[xx]`` language prefix). A song without a lyrics file trains as instrumental (empty lyrics).

Length bucketing: a clip trains on its first ``bucket`` seconds, the longest of ``AUDIO_BUCKETS`` it fills, so that
clips of similar length share micro-batches; clips shorter than the first bucket are left out with a warning. The
bucket travels as ``(seconds, 1)``: a 2-tuple, so the batching code that reads (width, height) groups by it.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..errors import DatasetError

log = logging.getLogger(__name__)

AUDIO_EXTENSIONS = {".wav", ".flac", ".mp3", ".ogg", ".m4a", ".opus", ".aac"}
LYRICS_SUFFIX = ".lyrics.txt"
# seconds a clip may train at (ACE-Step was trained on up to 240 s)
AUDIO_BUCKETS = (1, 2, 3, 5, 10, 15, 20, 30, 45, 60, 90, 120, 150, 180, 210, 240)
AUDIO_PREPROCESS_VERSION = "audio1"   # bump when the way a file becomes the VAE's waveform changes


def is_audio_file(path: Path) -> bool:
    return path.suffix.lower() in AUDIO_EXTENSIONS


def probe_seconds(path: Path) -> float | str:
    """The file's duration in seconds, or why PyAV cannot read it."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                return "no audio stream"
            stream = container.streams.audio[0]
            if stream.duration is not None and stream.time_base is not None:
                return float(stream.duration * stream.time_base)
            if container.duration is not None:
                return container.duration / 1_000_000
            samples = sum(frame.samples for frame in container.decode(stream))
            return samples / stream.codec_context.sample_rate
    except Exception as e:  # PyAV raises many types for bad files
        return f"{type(e).__name__}: {e}"


def audio_bucket(seconds: float) -> tuple[int, int] | None:
    """(the longest bucket the clip fills, 1), or None when it is shorter than every bucket."""
    fitting = [b for b in AUDIO_BUCKETS if b <= seconds + 1e-6]
    return (fitting[-1], 1) if fitting else None


def read_lyrics(audio_path: Path) -> str:
    """The lyrics beside an audio file (``song.lyrics.txt``), '' when there is none; ``DatasetError`` naming the file
    for anything but a regular file of at most MAX_CAPTION bytes (a FIFO would block the scan, /dev/zero fill
    memory)."""
    from ..fsutil import UnreadableFile, read_regular
    from .scan import MAX_CAPTION

    lyrics = audio_path.parent / (audio_path.stem + LYRICS_SUFFIX)
    try:
        data = read_regular(lyrics, MAX_CAPTION)
    except UnreadableFile as e:
        if e.missing:
            return ""
        raise DatasetError(f"{lyrics}: {e}; lyrics are a text file beside their song") from None
    return data.decode("utf-8-sig", errors="replace").strip()


def load_clip(path: Path, seconds: int) -> tuple[torch.Tensor, int]:
    """The first ``seconds`` of the file as ComfyUI's ``LoadAudio`` reads it: waveform [channels, samples] (float32
    in -1..1) and its sample rate."""
    from comfy_extras.nodes_audio import load

    waveform, sample_rate = load(str(path))
    return waveform[:, :int(round(seconds * sample_rate))], sample_rate


def _scan_audio_directory(cfg, directory, scan) -> None:
    from .items import MediaItem
    from .scan import _caption_extension, _read_caption

    path = Path(os.path.abspath(cfg.directory_path(directory)))
    if not path.is_dir():
        raise DatasetError(f"dataset directory not found: {path} (key 'directory.path' = {directory.path!r}); "
                           "fix the path or create the directory")
    extension = _caption_extension(cfg, directory)
    repeats = directory.num_repeats if directory.num_repeats is not None else cfg.num_repeats
    captions = cfg.caption_options(directory)
    found = 0
    for file in sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".") and is_audio_file(p)):
        seconds = probe_seconds(file)
        if isinstance(seconds, str):
            scan.unreadable.append((file, seconds))
            continue
        caption = _read_caption(file.parent / (file.stem + extension))
        if not caption and captions.skip_empty:
            scan.skipped_empty.append(file)
            continue
        if caption is None:
            scan.missing_captions.append(file)
        scan.items.append(MediaItem(path=file, caption=caption or "", width=0, height=0, num_repeats=repeats,
                                    resolutions=(), captions=captions, is_reg=directory.is_reg, seconds=seconds,
                                    lyrics=read_lyrics(file)))
        found += 1
    if not found:
        raise DatasetError(f"dataset directory {path} contains no readable audio files "
                           f"({', '.join(sorted(AUDIO_EXTENSIONS))}); add some or remove this [[directory]]")


def scan_audio(cfg):
    """Every readable audio file of every [[directory]] with its tags and lyrics, in sorted order (a
    ``scan.ScanResult``); unreadable files are reported as ``on_unreadable`` says."""
    from .scan import ScanResult, _report_unreadable

    scan = ScanResult(items=[])
    for directory in cfg.directory:
        _scan_audio_directory(cfg, directory, scan)
    _report_unreadable(cfg, scan.unreadable)
    return scan


def audio_examples(items) -> list:
    """One example per clip at its duration bucket; clips shorter than the first bucket are left out."""
    from .items import Example

    examples, short = [], []
    for item in items:
        bucket = audio_bucket(item.seconds)
        if bucket is None:
            short.append(item)
        else:
            examples.append(Example(item=item, bucket=bucket))
    if short:
        log.warning("leaving out %d audio file(s) shorter than %d s:%s", len(short), AUDIO_BUCKETS[0],
                    "".join(f"\n  {i.path}: {i.seconds:.2f} s" for i in short))
    return examples
