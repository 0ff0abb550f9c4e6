"""Check a saved LoRA the way a user will use it: loaded by ComfyUI's ``LoraLoaderModelOnly`` onto the base
model, its output compared with the training-side layers carrying the same adapter weights (LoRA or LoKr).
A full fine-tune's saved model: loaded by ComfyUI, its forward compared with the training-side layers."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..adapters import injection
from ..config import RunConfig
from ..models.registry import adapter_class
from ..host.runtime import ensure_comfyui


@dataclass
class LoRACheck:
    comfy_vs_training: float     # max |ComfyUI with LoRA - training layers with LoRA|
    lora_effect: float           # max |ComfyUI with LoRA - ComfyUI base|
    scale: float                 # max |ComfyUI base output|
    keys_loaded: int


def probe_inputs(adapter, seed: int = 0, size: tuple[int, int] = (8, 8)):
    """A fixed random latent, noise, timestep and text conditioning of the shapes the model takes."""
    g = torch.Generator().manual_seed(seed)
    x0 = adapter.probe_latent(g, size)
    noise = torch.randn(x0.shape, generator=g)
    t = adapter.objective().sample_t(1, adapter.seq_len(x0), g)
    text = adapter.probe_text(g)
    return x0, noise, t, text


def comfy_lora_model(patcher, lora_path: Path, strength: float = 1.0):
    import folder_paths

    from ..host.runtime import comfy_nodes

    folder_paths.add_model_folder_path("loras", str(lora_path.parent))
    (patched,) = comfy_nodes().LoraLoaderModelOnly().load_lora_model_only(patcher, lora_path.name, strength)
    return patched


def _model_device(adapter) -> torch.device:
    """Where the diffusion model's weights are now (ComfyUI moves them to its load device for a patch)."""
    return next(adapter.diffusion_model.parameters()).device


def _reference(adapter, x_t, t, text) -> torch.Tensor:
    dev = _model_device(adapter)
    return adapter.reference_forward(x_t.to(dev), t.to(dev), [x.to(dev) for x in text]).float().cpu()


def check_lora(cfg: RunConfig, lora_path: Path, seed: int = 0) -> LoRACheck:
    return check_loras(cfg, [lora_path], seed)[0]


def check_loras(cfg: RunConfig, lora_paths: list[Path], seed: int = 0) -> list[LoRACheck]:
    """``check_lora`` for each of a run's saved LoRAs (its epochs), the base model loaded and run once: every
    ComfyUI-side output first (each LoRA patched onto the base model, then unpatched), then the training layers with
    the adapter injected once and each file's weights loaded into it in turn."""
    ensure_comfyui()
    import comfy.model_management as mm

    adapter = adapter_class(cfg.model.type)(cfg.model, cfg.resolve)
    base = adapter.load_diffusion_model()
    x0, noise, t, text = probe_inputs(adapter, seed)
    x_t = adapter.objective().noisy(x0, noise, t)

    with torch.no_grad():
        base_out = _reference(adapter, x_t, t, text)
        comfy = []
        for path in lora_paths:
            patched = comfy_lora_model(base, path)
            mm.load_models_gpu([patched], force_full_load=True)
            adapter.use_model(patched)
            comfy.append((_reference(adapter, x_t, t, text), len(patched.patches)))
            # unpatching restores the patched weights from backups kept on the offload device (the CPU):
            # bring the whole model back to one device
            patched.unpatch_model(device_to=patched.load_device)
            adapter.use_model(base)

        injection.inject(adapter.diffusion_model, injection.spec_from_config(cfg.adapter), adapter.lora_block_prefixes,
                         cfg.adapter.target_modules)
        checks = []
        for path, (comfy_out, keys_loaded) in zip(lora_paths, comfy):
            injection.load_into(adapter.diffusion_model, injection.read_file(path))
            h = tuple(x.to(_model_device(adapter)) for x in (x0, noise, t, *text))
            for layer in adapter.to_layers():
                h = layer(h)
            train_out = h.float().cpu()
            checks.append(LoRACheck(comfy_vs_training=float((comfy_out - train_out).abs().max()),
                                    lora_effect=float((comfy_out - base_out).abs().max()),
                                    scale=float(base_out.abs().max()), keys_loaded=keys_loaded))
    return checks


@dataclass
class ModelCheck:
    comfy_vs_training: float     # max |ComfyUI's forward of the saved model - training layers with the same weights|
    change: float                # max |saved model's output - base model's output|
    scale: float


def check_full_model(cfg: RunConfig, model_path: Path, weights: dict[str, torch.Tensor] | None = None,
                     seed: int = 0) -> ModelCheck:
    """A full fine-tune's saved file loaded by ComfyUI (``models.loading``: ``comfy.sd.load_diffusion_model`` for
    files ComfyUI detects) vs the training layers holding ``weights`` (diffusion-model keys; default: the file's)."""
    import dataclasses

    from safetensors.torch import load_file

    ensure_comfyui()
    base = adapter_class(cfg.model.type)(cfg.model, cfg.resolve)
    base.load_diffusion_model()
    x0, noise, t, text = probe_inputs(base, seed)
    x_t = base.objective().noisy(x0, noise, t)
    saved = adapter_class(cfg.model.type)(dataclasses.replace(cfg.model, diffusion_model=str(model_path)), cfg.resolve)
    saved.load_diffusion_model()
    with torch.no_grad():
        base_out = _reference(base, x_t, t, text)
        comfy_out = _reference(saved, x_t, t, text)
        weights = load_file(str(model_path)) if weights is None else weights
        base.diffusion_model.load_state_dict(weights, strict=False)
        h = tuple(x.to(_model_device(base)) for x in (x0, noise, t, *text))
        for layer in base.to_layers():
            h = layer(h)
        train_out = h.float().cpu()
    return ModelCheck(comfy_vs_training=float((comfy_out - train_out).abs().max()),
                      change=float((comfy_out - base_out).abs().max()), scale=float(base_out.abs().max()))
