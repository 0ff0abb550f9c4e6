"""Sample images (and clips) for each saved epoch LoRA, rendered by ComfyUI's own sampler.

The base model is loaded whole, the way ComfyUI loads it, in a process of its own while the ranks wait
(``train/epoch_samples.py``), so the pipeline's memory layout is untouched. Who renders them is
``[samples] render``: ``"run"``: a separate process started by global rank 0 (``python -m pipetrain sample``);
``"host"``: the ComfyUI that started the run, on its own queue (``host_render.py`` has the request and marker
files), with the run's own render as the fallback when ComfyUI does not answer within ``host_timeout_s``.
Either way the PNGs (video models: animated WebP clips, ``clips.py``; audio models: FLAC songs, ``audio.py``) land
beside the LoRA and are announced in events.jsonl (``sample_saved``) and TensorBoard (a clip's first frame).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch

from . import audio as sample_audio, clips as sample_clips, controls as sample_controls, host_render
from ..cache import CacheStore, file_digest, text_key
from ..cache.builder import TextWork, encode_text
from ..cache.keys import caption_image
from ..config import RunConfig, load_run_config
from ..errors import ConfigError
from ..process.child import die_with_parent
from ..fsutil import fault_point, space_guard, temp_path_beside
from ..models.registry import adapter_class
from ..run.folder import cache_folder
from ..host.runtime import ensure_comfyui

log = logging.getLogger("pipetrain")


def sample_paths(lora_path: Path, count: int, strengths=(1.0,), suffix: str = ".png") -> list[Path]:
    """The files of ``count`` prompts at each LoRA strength, strength after strength: ``<lora>-sampleNN.png`` at
    strength 1 alone, else ``<lora>-sampleNN-x<strength>.png`` (video models' clips: ``.webp``)."""
    stem = lora_path.with_suffix("")
    if list(strengths) == [1.0]:
        return [Path(f"{stem}-sample{i:02d}{suffix}") for i in range(count)]
    return [Path(f"{stem}-sample{i:02d}-x{w:.2f}{suffix}") for w in strengths for i in range(count)]


def sample_strength(png: str) -> float:
    """The LoRA strength a sample was rendered at (``sample_paths``' names)."""
    tail = Path(png).stem.rpartition("-x")[2]
    try:
        return float(tail) if "-x" in Path(png).stem else 1.0
    except ValueError:
        return 1.0


def _text(adapter, store: CacheStore, prompt: str, state: dict, controls: tuple[Path, ...] = (),
          size: tuple[int, int] = (0, 0), lyrics: str = "") -> dict[str, torch.Tensor]:
    """A prompt's embedding from the content-addressed cache, encoded (and stored) when missing; models whose
    text encoder reads the control images read ``controls`` at the sample ``size`` with it; audio models encode
    the prompt as tags with ``lyrics``."""
    files = adapter.model_files()["text_encoders"]
    control, *more = controls or (None,)
    seen = caption_image(adapter, file_digest(control) if control else None, size, [file_digest(p) for p in more])
    key = text_key(prompt, [store.fingerprint(p) for p in files], adapter.arch, seen, lyrics=lyrics,
                   options=adapter.text_options())
    if not store.has("text", key):
        if "clip" not in state:
            state["clip"] = adapter.load_text_encoders()
        work = TextWork(prompt, str(control or ""), size, lyrics=lyrics, more_controls=tuple(map(str, more)))
        store.put("text", key, encode_text(adapter, state["clip"], work))
    return store.get("text", key)


def _conditioning(adapter, text: dict[str, torch.Tensor], guidance: float, references=()) -> list:
    """ComfyUI's CONDITIONING; an edit model's also carries the reference latents, as ComfyUI's ReferenceLatent
    node (one a node, chained) and TextEncodeQwenImageEditPlus add them."""
    cond = adapter.sample_conditioning(text, guidance)
    if references:
        cond = [[c, {**extra, "reference_latents": list(references)}] for c, extra in cond]
    return cond


def sample_control(cfg: RunConfig) -> tuple[Path, ...]:
    """Edit models' samples edit the control image(s) of the dataset's first sample (sorted by the first control
    image's file name)."""
    from ..data import scan_dataset

    controls = sorted(item.controls for item in scan_dataset(cfg.dataset_config).items if item.controls)
    if not controls:
        raise ConfigError("an edit model's samples need a control image: the dataset has none (control_path)",
                          file=cfg.file, key="samples")
    return controls[0]


def sample_reference(cfg: RunConfig, vae, controls: tuple[Path, ...]) -> list[torch.Tensor]:
    """Each of ``controls`` at the sample size, VAE-encoded as ComfyUI's VAEEncode gives it (the model scales
    it)."""
    from ..data import load_pixels

    s = cfg.samples
    with torch.no_grad():
        return [vae.encode(load_pixels(c, (s.width, s.height))[None]).float().cpu() for c in controls]


def render(cfg: RunConfig, lora_path: Path) -> list[Path]:
    """Render every sample prompt with the base model + ``lora_path`` (a full fine-tune: with the saved model
    ``lora_path`` itself); returns the PNG paths (video models: animated WebP clips, ``clips.py``)."""
    ensure_comfyui()
    import comfy.sample
    import comfy.samplers
    import numpy as np
    from PIL import Image

    s = cfg.samples
    if s.sampler not in comfy.samplers.KSampler.SAMPLERS or s.scheduler not in comfy.samplers.KSampler.SCHEDULERS:
        raise ConfigError(f"unknown sampler/scheduler {s.sampler!r}/{s.scheduler!r}; ComfyUI has "
                          f"{comfy.samplers.KSampler.SAMPLERS} and {comfy.samplers.KSampler.SCHEDULERS}",
                          file=cfg.file, key="samples.sampler")
    adapter = adapter_class(cfg.model.type)(cfg.model, cfg.resolve)
    store, state = CacheStore(cache_folder(cfg.resolve(cfg.output_dir))), {}
    # edit models' control images become reference latents; control-video models' (Wan VACE, Fun-Control) control
    # clip goes through their ComfyUI node instead (``controls.py``), read first so a missing file fails early
    controls = sample_control(cfg) if adapter.needs_control and not adapter.video_control else ()
    clip_controls = sample_controls.control_inputs(cfg, adapter) if adapter.video_control else None
    audio = sample_audio.is_audio(adapter)
    lyrics = s.lyrics.strip() if audio else ""   # the negative prompt's tags are sung without lyrics
    texts = [_text(adapter, store, p, state, controls, (s.width, s.height), lyrics) for p in s.prompts]
    texts.append(_text(adapter, store, s.negative_prompt, state, controls, (s.width, s.height)))
    state.clear()
    vae = adapter.load_vae()   # the run's (an all-in-one checkpoint's own: a saved full model holds no VAE)
    if cfg.adapter is None:   # a full fine-tune saved the whole diffusion model
        adapter = adapter_class(cfg.model.type)(dataclasses.replace(cfg.model, diffusion_model=str(lora_path)),
                                                cfg.resolve)
        models = [adapter.load_diffusion_model()]
    else:
        base = adapter.load_diffusion_model()
        models = [_with_lora(base, lora_path, strength) for strength in s.strengths]
    references = sample_reference(cfg, vae, controls)
    video = sample_clips.is_video(adapter)
    frames = s.frames if video else 1
    starts = sample_clips.start_images(cfg, adapter) if adapter.takes_start_image and clip_controls is None else None
    paths = sample_paths(lora_path, len(s.prompts), s.strengths if cfg.adapter is not None else (1.0,),
                         sample_audio.SUFFIX if audio else ".webp" if video else ".png")
    negative = _conditioning(adapter, texts[-1], s.guidance, references)
    with torch.no_grad():
        prompts = [_prepared(adapter, vae, _conditioning(adapter, text, s.guidance, references), negative, s, frames,
                             starts, clip_controls) for text in texts[:-1]]
    jobs = [(model, prompt) for model in models for prompt in prompts]
    for (model, (positive, unwanted, latent, trim)), path in zip(jobs, paths):
        with torch.no_grad():
            noise = comfy.sample.prepare_noise(latent["samples"], s.seed)
            out = comfy.sample.sample(model, noise, s.steps, s.cfg, s.sampler, s.scheduler, positive, unwanted,
                                      latent["samples"], noise_mask=latent.get("noise_mask"), seed=s.seed)
            if audio:
                sample_audio.save(sample_audio.decode(vae, out), path)   # written beside it, then renamed
                continue
            pixels = vae.decode(out[:, :, trim:] if trim else out)   # ComfyUI's TrimVideoLatent
            pixels = pixels.reshape(-1, *pixels.shape[-3:]).clamp(0, 1)   # [frames, H, W, 3]
        tmp = temp_path_beside(path)        # ComfyUI and the run may both render one epoch's samples
        with space_guard(path.parent, tmp):
            try:
                if video:
                    sample_clips.save_clip(pixels, tmp, s.fps or adapter.framerate)
                else:
                    Image.fromarray((pixels[0].cpu().float().numpy() * 255).round().astype(np.uint8)).save(
                        tmp, format="PNG")
                fault_point("sample-written")
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
    return paths


def _prepared(adapter, vae, positive: list, negative: list, s, frames: int, starts: list | None,
              controls: dict | None = None) -> tuple:
    """A prompt's (positive, negative, LATENT, latent frames to trim after sampling) for the sampler: a
    control-video model's as its ComfyUI node builds them from the control clip (``controls.py``), an i2v
    model's from the start image(s), else the empty latent (video models: of a ``frames``-frame clip)."""
    if controls is not None:
        return adapter.control_conditioning(vae, positive, negative, s.width, s.height, frames, **controls)
    if starts is not None:
        return (*adapter.start_conditioning(vae, positive, negative, s.width, s.height, frames, starts), 0)
    if sample_audio.is_audio(adapter):   # a song of ``seconds``, its empty latent as the model's ComfyUI node makes it
        return positive, negative, {"samples": adapter.audio_latent(s.seconds)}, 0
    video = sample_clips.is_video(adapter)
    latent = adapter.empty_latent(s.width, s.height, frames) if video else adapter.empty_latent(s.width, s.height)
    return positive, negative, {"samples": latent}, 0


def _with_lora(patcher, lora_path: Path, strength: float = 1.0):
    """What ComfyUI's ``LoraLoaderModelOnly`` does with the file, without adding its folder to ComfyUI's
    ``loras`` paths (this may run inside a long-lived ComfyUI). At strength 0 that is the base model itself, as
    that node returns it: no patches, so the base model's weights are not recomputed a second time."""
    import comfy.sd
    import comfy.utils

    if strength == 0:
        return patcher
    lora = comfy.utils.load_torch_file(str(lora_path), safe_load=True)
    patched, _ = comfy.sd.load_lora_for_models(patcher, None, lora, strength, 0)
    return patched


def render_and_mark(cfg: RunConfig, lora_path: Path, renderer: str) -> list[Path]:
    """``render``, then the marker beside the LoRA (``host_render.py``): the PNGs, or the error."""
    if cfg.samples is None:
        raise ConfigError("no [samples] table with prompts", file=cfg.file, key="samples")
    try:
        pngs = render(cfg, Path(lora_path))
    except Exception as e:
        with space_guard(Path(lora_path).parent):   # the marker finds no room either: the full disk is the error
            host_render.write_marker(lora_path, renderer=renderer, error=f"{type(e).__name__}: {e}")
        raise
    host_render.write_marker(lora_path, renderer=renderer, pngs=pngs)
    return pngs


def fulfil(request: Path, renderer: str) -> list[Path]:
    """Answer a run's sample request (``host_render.py``); an already answered one returns its PNGs."""
    req = host_render.read_request(request)
    lora = Path(req["lora"])
    marker = host_render.read_marker(lora)
    if marker and not marker.get("error") and all(Path(p).is_file() for p in marker["pngs"]):
        return [Path(p) for p in marker["pngs"]]
    return render_and_mark(load_run_config(req["run_toml"]), lora, renderer)


def main(config: str, lora: str) -> int:
    die_with_parent()   # started by a run (``train/epoch_samples.py``): never outlives it
    for path in render_and_mark(load_run_config(config), Path(lora), renderer="run"):
        print(json.dumps({"sample": str(path)}))
    return 0
