# SPDX-License-Identifier: GPL-3.0-or-later
"""Epoch-sample tests' helpers: ``render`` with ComfyUI's sampler replaced by a recorder, and small media files."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image


def picture(path: Path, rgb, size=(80, 64)) -> Path:
    """An image of colour ``rgb`` with a rectangle of another colour in it."""
    pixels = np.zeros((size[1], size[0], 3), np.uint8)
    pixels[:, :] = rgb
    pixels[8:40, 10:30] = (255 - rgb[0], 40, 200)
    Image.fromarray(pixels).save(path)
    return path


def webp_clip(path: Path, colours, size=(64, 64)) -> Path:
    """A lossless animated WebP, one frame of each colour, at 16 frames a second (Wan's rate)."""
    frames = [Image.fromarray(np.full((size[1], size[0], 3), c, np.uint8)) for c in colours]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=62, lossless=True)
    return path


def solid(colours, size=(64, 64)) -> torch.Tensor:
    """Frames [F, H, W, 3] in 0..1, one of each colour (what ``webp_clip`` stores, read back)."""
    return torch.stack([torch.tensor(c, dtype=torch.float32).div(255.0).expand(size[1], size[0], 3)
                        for c in colours])


def render_capturing(config: Path, monkeypatch, tmp_path):
    """``render`` with ComfyUI's sampler replaced by one that records what it is handed (and the LoRA left out:
    the base model samples); returns the calls, the written files and the run's VAE."""
    from pipetrain.backend.host.runtime import ensure_comfyui

    ensure_comfyui()
    import comfy.sample

    from pipetrain.backend.sampling import render as sampling
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.models.registry import adapter_class

    calls = []

    def fake_sample(model, noise, steps, cfg, sampler, scheduler, positive, negative, latent, **kw):
        calls.append({"positive": positive, "negative": negative, "latent": latent, **kw})
        return latent + noise   # frames that differ (WebP stores a repeated frame as a longer one)

    monkeypatch.setattr(comfy.sample, "sample", fake_sample)
    monkeypatch.setattr(sampling, "_with_lora", lambda patcher, path, strength=1.0: patcher)
    cfg = load_run_config(config)
    paths = sampling.render(cfg, tmp_path / "run-epoch0001.safetensors")
    vae = adapter_class(cfg.model.type)(cfg.model, cfg.resolve).load_vae()
    return calls, paths, vae


def encoded(vae, image: torch.Tensor) -> torch.Tensor:
    """ComfyUI's VAEEncode of frames [F, H, W, 3], as float32."""
    with torch.no_grad():
        return vae.encode(image).float()
