# SPDX-License-Identifier: GPL-3.0-or-later
"""Flux Kontext dev: Flux 1 dev's network trained on edit pairs, the control image given as reference tokens.

Kontext's weights have Flux 1 dev's layout (ComfyUI detects them as ``supported_models.Flux``, and so does
PipeTrain: a file cannot say it is Kontext, the ``[model] type`` does). ComfyUI's ``Flux._forward`` takes the
reference image's latent (``ref_latents``, which ``model_base.Flux.extra_conds`` scales with ``process_latent_in``
from ComfyUI's ReferenceLatent conditioning) as extra image tokens after the noisy image's, with the first RoPE
axis set to 1 and the image's own grid positions (its default "offset" method, one reference image); the
output keeps only the noisy image's tokens.

Here the reference is the dataset directory's control image (``control_path``, paired by file stem), encoded
at the training image's bucket with Flux's VAE and latent scaling when the cache is built (its
``conditioning_fields`` tensor ``reference``). The layers are Flux's: only the input layer differs (it appends
the reference tokens and tells the output layer how many follow the image's, in ``hw``). Loss, timesteps,
guidance and LoRA targets are Flux dev's (``flux.py``).
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import ModelError
from .flux import FLUX_SPEC, FluxAdapter, FluxInput

REFERENCE_INDEX = 1          # the first RoPE axis of reference tokens (ComfyUI's "offset" method, one image)


def _never(unet_config: dict) -> bool:
    return False


FLUX_KONTEXT_SPEC = dataclasses.replace(
    FLUX_SPEC, title="Flux Kontext dev", comfy_configs=("Flux",), example_file="flux1-kontext-dev.safetensors",
    accepts=_never)   # a Kontext file has Flux dev's layout: detection names it "flux"


class KontextInput(FluxInput):
    def run(self, latents, noise, t, context, pooled, reference):
        x = self.objective.noisy(latents, noise, t).to(self.dtype)
        img, img_ids = self._process_img(x)
        ref, ref_ids = self._process_img(reference.to(self.dtype), index=REFERENCE_INDEX)
        img, txt, vec, pe, hw = self.embed(x, torch.cat((img, ref), 1), torch.cat((img_ids, ref_ids), 1),
                                           t, context, pooled)
        return img, txt, vec, pe, torch.cat((hw, hw.new_tensor([ref.shape[1]])))   # the reference tokens follow


class FluxKontextAdapter(FluxAdapter):
    dp_diffusers_folder = True
    arch = "flux_kontext"
    dp_edit_of = "flux"
    dp_diffusers_lora = True
    spec = FLUX_KONTEXT_SPEC
    input_layer = KontextInput
    conditioning_fields = ("reference",)
    needs_control = True

    def encode_conditioning(self, vae, media, control):
        if control is None:
            raise ModelError("flux_kontext trains on edit pairs: give the dataset directory a control_path, a "
                             "folder of reference images named like the training images")
        return {"reference": self.encode_images(vae, control)[0]}

    def probe_text(self, generator):
        """The text fields and then a reference latent: what the first layer takes after the timestep."""
        return [*super().probe_text(generator), torch.randn(1, 16, 8, 8, generator=generator)]

    def reference_forward(self, x_t, t, text):
        context, pooled, reference = text
        dm = self.diffusion_model
        guidance = torch.full_like(t, self.cfg.guidance) if dm.params.guidance_embed else None
        return dm(x_t.to(self.dtype), t, context.to(self.dtype), y=pooled.to(self.dtype), guidance=guidance,
                  ref_latents=[reference.to(self.dtype)])
