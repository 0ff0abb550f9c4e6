"""Sample images for each saved epoch LoRA, rendered by ComfyUI's own sampler.

Training runs on every rank; the samples are rendered by a separate process started by global rank 0
(``python -m pipetrain sample``) while the other ranks wait, so the pipeline's memory layout is untouched
and the base model is loaded whole, the way ComfyUI loads it. PNGs land beside the LoRA and are announced
in events.jsonl and TensorBoard.
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import torch

from .cache import CacheStore, model_fingerprint, text_key
from .config import RunConfig, load_run_config
from .errors import ConfigError
from .models.registry import adapter_class
from .runtime import ensure_comfyui
from .train import distributed

log = logging.getLogger("pipetrain")


def sample_paths(lora_path: Path, count: int) -> list[Path]:
    stem = lora_path.with_suffix("")
    return [Path(f"{stem}-sample{i:02d}.png") for i in range(count)]


def render_epoch_samples(trainer, lora_path: Path | None, epoch: int) -> None:
    cfg = trainer.cfg
    if cfg.samples is None:
        return
    if trainer.rank == 0 and lora_path is not None:
        cmd = [sys.executable, "-m", "pipetrain", "sample", str(trainer.run_dir / "run.toml"), str(lora_path)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            message = f"sampling failed for epoch {epoch}: {proc.stderr.strip().splitlines()[-1:]}"
            trainer.reporter.event("warning", message=message)
            log.warning("%s\n%s", message, proc.stderr[-2000:])
        else:
            _announce(trainer, lora_path, epoch)
    distributed.barrier()


def _announce(trainer, lora_path: Path, epoch: int) -> None:
    prompts = trainer.cfg.samples.prompts
    for i, (prompt, png) in enumerate(zip(prompts, sample_paths(lora_path, len(prompts)))):
        trainer.reporter.event("sample_saved", epoch=epoch, step=trainer.global_step, path=str(png), prompt=prompt)
        trainer.reporter.image(f"samples/{i:02d}", png, trainer.global_step)


def _text(adapter, store: CacheStore, prompt: str, state: dict) -> dict[str, torch.Tensor]:
    """A prompt's embedding from the content-addressed cache, encoded (and stored) when missing."""
    files = adapter.model_files()["text_encoders"]
    key = text_key(prompt, [model_fingerprint(p) for p in files], adapter.arch)
    if not store.has("text", key):
        if "clip" not in state:
            state["clip"] = adapter.load_text_encoders()
        with torch.no_grad():
            store.put("text", key, adapter.encode_caption(state["clip"], prompt))
    return store.get("text", key)


def _conditioning(adapter, text: dict[str, torch.Tensor], guidance: float) -> list:
    return adapter.sample_conditioning(text, guidance)


def render(cfg: RunConfig, lora_path: Path) -> list[Path]:
    """Render every sample prompt with the base model + ``lora_path``; returns the PNG paths."""
    ensure_comfyui()
    import comfy.sample
    import comfy.samplers
    import numpy as np
    from PIL import Image

    from .verify import comfy_lora_model

    s = cfg.samples
    if s.sampler not in comfy.samplers.KSampler.SAMPLERS or s.scheduler not in comfy.samplers.KSampler.SCHEDULERS:
        raise ConfigError(f"unknown sampler/scheduler {s.sampler!r}/{s.scheduler!r}; ComfyUI has "
                          f"{comfy.samplers.KSampler.SAMPLERS} and {comfy.samplers.KSampler.SCHEDULERS}",
                          file=cfg._file, key="samples.sampler")
    adapter = adapter_class(cfg.model.type)(cfg.model, cfg.resolve)
    store, state = CacheStore(cfg.resolve(cfg.output_dir) / "cache"), {}
    texts = [_text(adapter, store, p, state) for p in [*s.prompts, s.negative_prompt]]
    state.clear()
    model = comfy_lora_model(adapter.load_diffusion_model(), lora_path)
    vae = adapter.load_vae()
    negative = _conditioning(adapter, texts[-1], s.guidance)
    paths = sample_paths(lora_path, len(s.prompts))
    for text, png in zip(texts[:-1], paths):
        latent = adapter.empty_latent(s.width, s.height)
        noise = comfy.sample.prepare_noise(latent, s.seed)
        with torch.no_grad():
            out = comfy.sample.sample(model, noise, s.steps, s.cfg, s.sampler, s.scheduler,
                                      _conditioning(adapter, text, s.guidance), negative, latent, seed=s.seed)
            pixels = vae.decode(out)
            pixels = pixels.reshape(-1, *pixels.shape[-3:])[0].clamp(0, 1)   # a video model's first frame
        Image.fromarray((pixels.cpu().float().numpy() * 255).round().astype(np.uint8)).save(png)
    return paths


def main(config: str, lora: str) -> int:
    cfg = load_run_config(config)
    if cfg.samples is None:
        raise ConfigError("no [samples] table with prompts", file=cfg._file, key="samples")
    for path in render(cfg, Path(lora)):
        print(json.dumps({"sample": str(path)}))
    return 0
