# SPDX-License-Identifier: GPL-3.0-or-later
"""Epoch samples of audio models: each prompt (the tags, with ``[samples] lyrics``) rendered as a song of
``[samples] seconds``, the way a user generates one in ComfyUI.

The empty latent is the one the model's own ComfyUI node makes (the adapter's ``audio_latent``), the text is encoded
as the model's text node encodes tags and lyrics (the adapter's ``encode_song``, through the prompt cache), the
sampler is the one every other type samples with, the waveform comes from ComfyUI's ``VAEDecodeAudio`` and the file is
written by the function behind ComfyUI's ``SaveAudio`` node: FLAC, 44.1 kHz stereo as the VAE decodes it.
"""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import torch

from ..host.runtime import ensure_comfyui

SUFFIX = ".flac"                 # what ComfyUI's SaveAudio writes
# an audio sample's suffix -> the type it is served as (the panel's samples route)
AUDIO_TYPES = {".flac": "audio/flac", ".wav": "audio/wav", ".mp3": "audio/mpeg", ".ogg": "audio/ogg",
               ".opus": "audio/ogg"}


def is_audio(adapter) -> bool:
    """Whether this adapter (class or instance) trains on audio: its epoch samples are songs."""
    return getattr(adapter, "audio", False)


def is_audio_file(path) -> bool:
    return Path(path).suffix.lower() in AUDIO_TYPES


def decode(vae, latent: torch.Tensor) -> dict:
    """ComfyUI's ``VAEDecodeAudio`` on a sampled latent: {"waveform": [B, channels, samples], "sample_rate"}."""
    ensure_comfyui()
    from comfy_extras.nodes_audio import VAEDecodeAudio

    return VAEDecodeAudio().decode(vae, {"samples": latent})[0]


def save(audio: dict, path: Path) -> None:
    """The first song of ``audio`` written to ``path`` by ComfyUI's ``SaveAudio`` code (FLAC through PyAV), which
    names its files itself (``<prefix>_00001_.flac``) in the folder it is given: written beside ``path``, then
    renamed to it."""
    ensure_comfyui()
    from comfy_extras.nodes_audio import save_audio

    path = Path(path)
    saver = SimpleNamespace(output_dir=str(path.parent), prefix_append="", type="output")
    first = {"waveform": audio["waveform"][:1], "sample_rate": audio["sample_rate"]}
    result = save_audio(saver, first, filename_prefix=f".{path.stem}.{os.getpid()}", format=SUFFIX[1:])
    written = path.parent / result["ui"]["audio"][0]["subfolder"] / result["ui"]["audio"][0]["filename"]
    os.replace(written, path)


def load(path: Path) -> tuple[torch.Tensor, int]:
    """A sample file read back as ComfyUI's ``LoadAudio`` reads it: waveform [channels, samples], sample rate."""
    ensure_comfyui()
    from comfy_extras.nodes_audio import load as comfy_load

    return comfy_load(str(path))


def check_samples(cfg) -> None:
    """``[samples] lyrics`` only for audio models (an image or video model's prompt has no lyrics to sing)."""
    from ..errors import ConfigError
    from ..models.registry import adapter_class, types_with

    if cfg.samples is None or not cfg.samples.lyrics.strip() or is_audio(adapter_class(cfg.model.type)):
        return
    raise ConfigError(f"a {cfg.model.type} model's samples are pictures, with nothing to sing; lyrics are for the "
                      f"audio types ({', '.join(types_with('audio'))}): leave samples.lyrics empty", file=cfg.file,
                      key="samples.lyrics")
