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
from pathlib import Path

import torch

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
    """The lyrics beside an audio file (``song.lyrics.txt``), '' when there is none."""
    lyrics = audio_path.parent / (audio_path.stem + LYRICS_SUFFIX)
    try:
        return lyrics.read_text(encoding="utf-8-sig").strip()
    except FileNotFoundError:
        return ""


def load_clip(path: Path, seconds: int) -> tuple[torch.Tensor, int]:
    """The first ``seconds`` of the file as ComfyUI's ``LoadAudio`` reads it: waveform [channels, samples] (float32
    in -1..1) and its sample rate."""
    from comfy_extras.nodes_audio import load

    waveform, sample_rate = load(str(path))
    return waveform[:, :int(round(seconds * sample_rate))], sample_rate
