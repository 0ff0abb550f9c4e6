"""Check a saved LoRA the way a user will use it: loaded by ComfyUI's ``LoraLoaderModelOnly`` onto the base
model, its output compared with the training-side layers carrying the same adapter weights."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from . import lora
from .config import RunConfig
from .models.registry import adapter_class
from .runtime import ensure_comfyui


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
    t = adapter.objective().sample_t(1, size[0] * size[1] // 4, g)
    text = adapter.probe_text(g)
    return x0, noise, t, text


def comfy_lora_model(patcher, lora_path: Path, strength: float = 1.0):
    import folder_paths

    from .runtime import comfy_nodes

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
    ensure_comfyui()
    import comfy.model_management as mm

    adapter = adapter_class(cfg.model.type)(cfg.model, cfg.resolve)
    base = adapter.load_diffusion_model()
    x0, noise, t, text = probe_inputs(adapter, seed)
    x_t = adapter.objective().noisy(x0, noise, t)

    with torch.no_grad():
        base_out = _reference(adapter, x_t, t, text)
        patched = comfy_lora_model(base, lora_path)
        keys_loaded = len(patched.patches)
        mm.load_models_gpu([patched], force_full_load=True)
        adapter.patcher = patched
        comfy_out = _reference(adapter, x_t, t, text)
        # unpatching restores the patched weights from backups kept on the offload device (the CPU):
        # bring the whole model back to one device
        patched.unpatch_model(device_to=patched.load_device)
        adapter.patcher = base

        spec = lora.LoRASpec(rank=cfg.adapter.rank, alpha=cfg.adapter.alpha or float(cfg.adapter.rank))
        lora.inject(adapter.diffusion_model, spec, adapter.lora_block_prefixes, cfg.adapter.target_modules)
        lora.load_into(adapter.diffusion_model, lora.read_file(lora_path))
        h = tuple(x.to(_model_device(adapter)) for x in (x0, noise, t, *text))
        for layer in adapter.to_layers():
            h = layer(h)
        train_out = h.float().cpu()
    return LoRACheck(comfy_vs_training=float((comfy_out - train_out).abs().max()),
                     lora_effect=float((comfy_out - base_out).abs().max()),
                     scale=float(base_out.abs().max()), keys_loaded=keys_loaded)
