"""Wan 2.2 TI2V 5B: ComfyUI's ``WanModel`` on the Wan 2.2 VAE's latents (``comfy.ldm.wan.vae2_2``: 48 channels,
16x spatial and 4x temporal compression, latent format ``Wan22``), at 24 fps. ComfyUI detects it as WAN22_T2V
(48 channels in and out) and builds ``model_base.WAN22``.

The layers are Wan's (``wan.py``); what differs is the latent (48 channels, 32-pixel bucket sides: 16x VAE
times the 2x2 patch) and the frame rate. Two types:

- ``wan22_5b``: text-to-video (and text-to-image on stills), rectified flow over every latent frame.
- ``wan22_5b_i2v``: the text-image-to-video mode ComfyUI samples with ``Wan22ImageToVideoLatent``: the first
  latent frame is the clean latent of the clip's first frame (cached as ``first_frame``; the Wan 2.2 VAE's
  first latent frame depends on the first pixel frame only), its timestep is 0 and the others' t
  (``WAN22.process_timestep`` over the ``denoise_mask``), and the loss covers the other frames (ComfyUI
  replaces the first frame's prediction by the given latent). Clips only.
"""
from __future__ import annotations

import torch

from .base import GivenFirstFrame
from .spec import ArchSpec
from .wan import WanAdapter, build_wan, first_frame_mask, nodes_wan, wan_config

WAN22_FPS = 24

# full: Wan2.2-TI2V-5B (24 heads of 128). tiny: 2 blocks at width 256, which ComfyUI still detects.
WAN22_5B_CONFIGS = {"full": wan_config(3072, 14336, 30, in_dim=48, out_dim=48),
                    "tiny": wan_config(256, 512, 2, in_dim=48, out_dim=48)}


def wan22_5b_config(size: str) -> dict:
    return dict(WAN22_5B_CONFIGS["full" if size == "full" else "tiny"])


WAN22_5B_SPEC = ArchSpec(
    title="Wan 2.2 TI2V 5B", comfy_configs=("WAN22_T2V",), unet_config=wan22_5b_config, build=build_wan,
    detected_sizes=("tiny", "full"), text_encoders=("umt5xxl",), clip_type="WAN", vae="wan22",
    example_file="wan2.2_ti2v_5B_fp16.safetensors")


class Wan22Adapter(WanAdapter):
    arch = "wan22_5b"
    spec = WAN22_5B_SPEC
    latent_format = "Wan22"
    framerate = WAN22_FPS
    spatial_multiple = 32       # 16x VAE x 2x2 patches
    latent_channels = 48
    vae_scale = 16


class Wan22I2VAdapter(GivenFirstFrame, Wan22Adapter):
    arch = "wan22_5b_i2v"
    still_type = "wan22_5b"

    def reference_forward(self, x_t, t, text):
        """ComfyUI's WAN22 under Wan22ImageToVideoLatent: the first frame given, per-frame timesteps."""
        context, first = text
        x = torch.cat([first.to(x_t.dtype), x_t[:, :, 1:]], dim=2)
        timestep = self.objective().model_timestep(t)[:, None] * first_frame_mask(x.shape[2], t)
        return self.diffusion_model(x.to(self.dtype), timestep, context.to(self.dtype))

    takes_start_image = True

    def start_conditioning(self, vae, positive, negative, width, height, frames, images):
        """ComfyUI's Wan22ImageToVideoLatent: the start image's latent as the first latent frame, kept by the
        latent's noise mask; the prompts' conditioning unchanged."""
        (latent,) = nodes_wan().Wan22ImageToVideoLatent.execute(vae, width, height, frames, 1,
                                                                start_image=images[0]).result
        return positive, negative, latent
