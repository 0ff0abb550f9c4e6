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
    channels = adapter.diffusion_model.in_channels // (getattr(adapter.diffusion_model, "patch_size", 1) ** 2) \
        if adapter.arch == "flux" else adapter.diffusion_model.in_channels
    x0 = torch.randn(1, channels, *size, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    t = adapter.objective().sample_t(1, size[0] * size[1] // 4, g)
    text = adapter.probe_text(g)
    return x0, noise, t, text


def comfy_lora_model(patcher, lora_path: Path, strength: float = 1.0):
    import folder_paths
    import nodes

    folder_paths.add_model_folder_path("loras", str(lora_path.parent))
    (patched,) = nodes.LoraLoaderModelOnly().load_lora_model_only(patcher, lora_path.name, strength)
    return patched


def check_lora(cfg: RunConfig, lora_path: Path, seed: int = 0) -> LoRACheck:
    ensure_comfyui()
    import comfy.model_management as mm

    adapter = adapter_class(cfg.model.type)(cfg.model, cfg.resolve)
    base = adapter.load_diffusion_model()
    x0, noise, t, text = probe_inputs(adapter, seed)
    x_t = adapter.objective().noisy(x0, noise, t)

    with torch.no_grad():
        base_out = adapter.reference_forward(x_t, t, text).float()
        patched = comfy_lora_model(base, lora_path)
        keys_loaded = len(patched.patches)
        mm.load_models_gpu([patched], force_full_load=True)
        adapter.patcher = patched
        comfy_out = adapter.reference_forward(x_t, t, text).float()
        patched.unpatch_model()
        adapter.patcher = base

        spec = lora.LoRASpec(rank=cfg.adapter.rank, alpha=cfg.adapter.alpha or float(cfg.adapter.rank))
        lora.inject(adapter.diffusion_model, spec, adapter.lora_block_prefixes, cfg.adapter.target_modules)
        lora.load_into(adapter.diffusion_model, lora.read_file(lora_path))
        h = (x0, noise, t, *text)
        for layer in adapter.to_layers():
            h = layer(h)
        train_out = h.float()
    return LoRACheck(comfy_vs_training=float((comfy_out - train_out).abs().max()),
                     lora_effect=float((comfy_out - base_out).abs().max()),
                     scale=float(base_out.abs().max()), keys_loaded=keys_loaded)
