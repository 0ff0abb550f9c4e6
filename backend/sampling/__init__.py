"""Epoch samples: images, clips and songs rendered with the host ComfyUI's own sampler, by the run's ranks or by
the ComfyUI that started it."""
