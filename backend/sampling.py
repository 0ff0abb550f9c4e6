"""Sample images for a saved epoch LoRA, rendered by ComfyUI's own sampler (placeholder: filled in next)."""
from __future__ import annotations


def render_epoch_samples(trainer, lora_path, epoch: int) -> None:
    return None
