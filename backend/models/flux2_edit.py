# SPDX-License-Identifier: GPL-3.0-or-later
"""Flux 2 dev with reference images: the edit mode ComfyUI samples by chaining ReferenceLatent nodes onto Flux 2's
conditioning.

The network and its files are Flux 2 dev's (``flux2.py``; a file cannot say how it will be used, so detection
names it ``flux2`` and the ``[model] type`` chooses this one). ComfyUI's ``Flux._forward`` appends each reference
latent (``ref_latents``: ``model_base.Flux.extra_conds`` scales ReferenceLatent's raw VAE latents with
``process_latent_in``) as extra image tokens after the noisy image's, by Flux 2's default "index" method: the
k-th reference (from 1) has its first RoPE axis at k x ``ref_index_scale`` (10 for Flux 2 dev) and its own grid
positions from 0; the output keeps the noisy image's tokens only.

Here the references are the dataset directory's control images (``control_path``; a list of folders gives each
sample several, in the list's order), each resized to the training image's bucket (diffusion-pipe's rule for
control images) and encoded with Flux 2's VAE and latent scaling when the cache is built: the conditioning field
``references`` [N, 128, h, w]. Only the input layer differs from Flux 2's (it appends the reference tokens and
tells the output layer how many follow the image's, in ``hw``); loss, timesteps, guidance and LoRA targets are
Flux 2's.
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import ModelError
from .flux2 import FLUX2_SPEC, Flux2Adapter, Flux2Input

# BFL describes Flux 2 dev as taking up to 10 reference images; each adds its tokens to every attention
MAX_REFERENCES = 10


def _never(unet_config: dict) -> bool:
    return False


FLUX2_EDIT_SPEC = dataclasses.replace(FLUX2_SPEC, title="Flux 2 dev (edit, reference images)",
                                      accepts=_never)   # Flux 2 dev's layout: detection names it "flux2"


class Flux2EditInput(Flux2Input):
    def run(self, latents, noise, t, context, references):
        x = self.objective.noisy(latents, noise, t).to(self.dtype)
        img, img_ids = self._process_img(x)
        refs, ref_ids = [], []
        for k, ref in enumerate(references.unbind(1), start=1):   # ComfyUI's "index" method
            r, r_ids = self._process_img(ref.to(self.dtype), index=k * self.params.ref_index_scale)
            refs.append(r)
            ref_ids.append(r_ids)
        count = sum(r.shape[1] for r in refs)
        img, txt, mods, pe, hw = self.embed(x, torch.cat((img, *refs), 1), torch.cat((img_ids, *ref_ids), 1), t,
                                            context)
        return img, txt, mods, pe, torch.cat((hw, hw.new_tensor([count])))   # the reference tokens follow


class Flux2EditAdapter(Flux2Adapter):
    arch = "flux2_edit"
    dp_edit_of = "flux2"
    spec = FLUX2_EDIT_SPEC
    conditioning_fields = ("references",)
    needs_control = True
    max_controls = MAX_REFERENCES

    def encode_conditioning(self, vae, media, control):
        if control is None:
            raise ModelError("flux2_edit trains on edit pairs: give the dataset directory a control_path, a folder "
                             "of reference images named like the training images (or a list of such folders)")
        return {"references": self.encode_images(vae, control)}

    def to_layers(self):
        layers = super().to_layers()
        layers[0] = Flux2EditInput(self.diffusion_model, self.objective(), self.dtype, self.cfg.guidance)
        return layers

    def probe_text(self, generator):
        """The text and then the reference latents (two, [1, 2, 128, 8, 8]): what the first layer takes after
        the timestep."""
        return [*super().probe_text(generator), torch.randn(1, 2, 128, 8, 8, generator=generator)]

    def reference_forward(self, x_t, t, text):
        context, references = text
        dm = self.diffusion_model
        guidance = torch.full_like(t, self.cfg.guidance) if dm.params.guidance_embed else None
        return dm(x_t.to(self.dtype), t, context.to(self.dtype), guidance=guidance,
                  ref_latents=[r.to(self.dtype) for r in references.unbind(1)])
