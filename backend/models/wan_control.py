# SPDX-License-Identifier: GPL-3.0-or-later
"""Wan 2.1 VACE and Wan 2.1 Fun-Control: Wan trained on (control video, clip) pairs, the control conditioning built
by ComfyUI's own nodes (``comfy_extras.nodes_wan``) on the control files the dataset's ``control_path`` pairs with
the clips by file stem (a control video, or image, per clip or still), cached with the latent. A clip's control
video is read up to the clip's length (``cache.builder._control_video``); the nodes fill what it lacks.

- ``wan_vace`` (ComfyUI's ``WAN21_Vace``, ``VaceWanModel``): ``WanVaceToVideo`` at strength 1 encodes the
  control twice (the inactive and reactive halves under the mask, 32 channels) and gives a 64-channel mask (all
  ones without the dataset's ``control_mask_path``; a ``reference_path`` image adds its latent frame in front,
  its mask zero); ``WAN21_Vace.extra_conds`` turns both into ``vace_context`` (the latents scaled as the model's
  inputs, then the mask: 96 channels), which is what is cached. The network is Wan's blocks plus the VACE blocks:
  after main block i, VACE block ``vace_layers_mapping[i]`` reads the control tokens and the patch embedding of
  the noisy input, and its skip output is added to the hidden state (``VaceWanModel.forward_orig``). The
  reference frame is in the noisy input, as ComfyUI samples the node's longer latent, and out of the prediction
  the loss sees (``TrimVideoLatent``). LoRA goes on the main blocks (as on Wan): the VACE path depends on frozen
  weights only, so its tokens and the embedded input travel hidden (``carry.hide``) and need no gradient.
- ``wan_fun_control`` (ComfyUI's ``WAN21_FunControl2V``: Wan 2.1 i2v with 48 input channels): ``WanFunControlToVideo``
  with the control video and the clip's first frame as ``start_image`` gives 32 channels (the control's latent,
  then the first frame's latent followed by zero frames), concatenated to the noisy latent after
  ``WAN21.concat_cond``'s scaling; with ``[model] clip_vision`` the first frame's CLIP-vision tokens too, as
  ``wan_i2v`` takes them. Clips only (the first frame is given), unless ``[model] control_start_image = false``:
  the node without a start image (those 16 channels zero), and stills train too.
"""
from __future__ import annotations

import torch

from ..errors import ConfigError, ModelError
from .attention import sdpa_transformer_options
from .carry import hide, reveal, sizes
from .spec import ArchSpec, comfy_diffusion_model
from .wan import WanAdapter, WanBlock, WanI2VAdapter, WanInput, WanOutput, build_wan, nodes_wan, wan_config

VACE_STRENGTH = 1.0   # WanVaceToVideo's strength; the skip outputs are scaled by it
VACE_CHANNELS = 96    # 2 x 16 latent channels + 64 mask channels (the 8 x 8 pixels under a latent cell)


def wan_vace_config(size: str) -> dict:
    """full: Wan2.1-VACE-14B (a VACE block after every 5th of the 40 blocks); tiny: 2 blocks, one VACE block."""
    dims, vace_layers = ((5120, 13824, 40), 8) if size == "full" else ((256, 512, 2), 1)
    return {**wan_config(*dims, model_type="vace"), "vace_in_dim": VACE_CHANNELS, "vace_layers": vace_layers}


def wan_fun_control_config(size: str) -> dict:
    """full: Wan2.1-Fun-14B-Control (16 noisy + 16 control + 16 start-image channels, CLIP-vision projection)."""
    dims = (5120, 13824, 40) if size == "full" else (256, 512, 2)
    return wan_config(*dims, in_dim=48, model_type="i2v")


WAN_VACE_SPEC = ArchSpec(
    title="Wan 2.1 VACE", comfy_configs=("WAN21_Vace",), unet_config=wan_vace_config,
    build=comfy_diffusion_model("comfy.ldm.wan.model:VaceWanModel"), detected_sizes=("tiny", "full"),
    text_encoders=("umt5xxl",), clip_type="WAN", vae="wan21", example_file="wan2.1_vace_14B_fp16.safetensors")

WAN_FUN_CONTROL_SPEC = ArchSpec(
    title="Wan 2.1 Fun-Control", comfy_configs=("WAN21_FunControl2V",), unet_config=wan_fun_control_config,
    build=build_wan, detected_sizes=("tiny", "full"), text_encoders=("umt5xxl",), clip_type="WAN", vae="wan21",
    example_file="wan2.1_fun_control_1.3B_bf16.safetensors")


def _no_text():
    return [[torch.zeros(1, 1, 1), {}]]   # the nodes carry conditioning through; the text is cached apart


def scaled_latents(latent: torch.Tensor) -> torch.Tensor:
    """Each group of 16 channels scaled as the model's input (``process_latent_in``), as ComfyUI's WAN21 does to
    ``concat_latent_image`` and WAN21_Vace to ``vace_frames``."""
    import comfy.latent_formats
    fmt = comfy.latent_formats.Wan21()
    return torch.cat([fmt.process_in(part) for part in latent.float().split(16, dim=1)], dim=1)


def _frames_check(arch: str, media: torch.Tensor, control: torch.Tensor | None):
    if control is None:
        raise ModelError(f"{arch}: a sample has no control file; set control_path on every [[directory]]")
    if media.shape[1:3] != control.shape[1:3]:
        raise ModelError(f"{arch}: control {tuple(control.shape[1:3])} and clip {tuple(media.shape[1:3])} differ")


# --- VACE ---------------------------------------------------------------------------------------
class VaceInput(WanInput):
    """Wan's embedders, then the control tokens (``vace_patch_embedding`` of ``vace_context``) and the embedded
    noisy input the first VACE block adds to them, both carried after the 7 tensors Wan's layers pass, then how
    many reference frames lead the latent (``sizes``).

    With a reference image (``vace_context`` longer than the latent by its ``trim_latent`` frames), the noisy latent
    gets those frames in front, as ComfyUI samples the node's longer latent: their clean value is the reference's
    latent (``vace_context``'s first 16 channels there), noised at the sample's t with ``ref_noise`` (the feed
    draws it; zeros where a check passes none)."""

    def __init__(self, dm, objective, dtype):
        super().__init__(dm, objective, dtype, ("vace_context",))
        self.vace_patch_embedding = dm.vace_patch_embedding

    def run(self, latents, noise, t, context, vace_context, ref_noise=None):
        trim = vace_context.shape[2] - latents.shape[2]
        if trim:
            reference = vace_context[:, :16, :trim].to(latents.dtype)
            ref_noise = torch.zeros_like(reference) if ref_noise is None else ref_noise.to(noise.dtype)
            latents, noise = torch.cat([reference, latents], dim=2), torch.cat([ref_noise, noise], dim=2)
        embedded = self.embed(latents, noise, t, context)
        vace_context = vace_context.to(self.dtype)
        c = self.vace_patch_embedding(vace_context.float()).to(vace_context.dtype).flatten(2).transpose(1, 2)
        return (*self.carried(*embedded), hide(c), hide(embedded[0]), sizes(trim))


class VaceBlock(WanBlock):
    """Main block i, then (where ``vace_layers_mapping`` names one) its VACE block: the skip output is added to
    the hidden state at strength 1."""

    def __init__(self, block, vace_block, dtype):
        super().__init__(block, dtype)
        self.vace_block = vace_block
        if vace_block is not None:
            self.cost = 2.0

    def run(self, x, e0, e, context, freqs, grid, size, c, x_orig, trim):
        x, *rest = super().run(x, e0, e, context, freqs, grid, size)
        if self.vace_block is not None:
            skip, c_next = self.vace_block(
                reveal(c, self.dtype), x=reveal(x_orig, self.dtype), e=reveal(e0, self.dtype),
                freqs=reveal(freqs, torch.float32), context=reveal(context, self.dtype),
                context_img_len=int(size[3]) or None, transformer_options=sdpa_transformer_options())
            x = x + skip * VACE_STRENGTH
            c = hide(c_next)
        return (x, *rest, c, x_orig, trim)


class VaceOutput(WanOutput):
    """Wan's head; the reference frames' prediction left out (ComfyUI's ``TrimVideoLatent`` after sampling), so
    the loss, masks and preservation see the clip's frames only."""

    def run(self, x, e0, e, context, freqs, grid, size, c, x_orig, trim):
        return super().run(x, e0, e, context, freqs, grid, size)[:, :, int(trim[0]):]


class WanVaceAdapter(WanAdapter):
    arch = "wan_vace"
    spec = WAN_VACE_SPEC
    conditioning_fields = ("vace_context",)
    needs_control = True
    video_control = True    # a clip's control is a video of its frame bucket (a still's an image)
    vace_inputs = True      # [[directory]] control_mask_path / reference_path

    def to_layers(self):
        dm = self.diffusion_model
        vace = {i: dm.vace_blocks[n] for i, n in dm.vace_layers_mapping.items()}
        return [VaceInput(dm, self.objective(), self.dtype),
                *(VaceBlock(b, vace.get(i), self.dtype) for i, b in enumerate(dm.blocks)),
                VaceOutput(dm, self.dtype)]

    def encode_conditioning(self, vae, media, control, control_mask=None, reference=None):
        """``control_mask``: frames [T, H, W, 3] (or an image: one frame) whose red channel is the node's
        ``control_masks`` (white: generate there); ``reference``: the reference image [1, H, W, 3]."""
        _frames_check(self.arch, media, control)
        frames, height, width = media.shape[:3]
        positive = self.control_conditioning(vae, _no_text(), _no_text(), width, height, frames, control,
                                             control_mask=control_mask, reference=reference)[0][0][1]
        return {"vace_context": vace_context(positive["vace_frames"][0], positive["vace_mask"][0])[0].cpu()}

    def control_conditioning(self, vae, positive, negative, width, height, frames, control, control_mask=None,
                             reference=None):
        """ComfyUI's WanVaceToVideo at strength 1 (``control_mask``'s red channel is its control_masks): the
        conditioning training caches, and samples render with; its trim_latent counts the reference's frame."""
        masks = None if control_mask is None else control_mask[..., 0]
        return tuple(nodes_wan().WanVaceToVideo.execute(positive, negative, vae, width, height, frames, 1,
                                                         VACE_STRENGTH, control_video=control, control_masks=masks,
                                                         reference_image=reference).result)

    def extra_noise_shape(self, payload):
        """The reference frames' noise (``VaceInput``): as many frames as ``vace_context`` has beyond the latent."""
        latent, vace = payload["latent"], payload["vace_context"]
        trim = vace.shape[1] - latent.shape[1]
        return (latent.shape[0], trim, *latent.shape[2:]) if trim else None

    def probe_text(self, generator):
        return [*super().probe_text(generator), torch.randn(1, VACE_CHANNELS, 2, 8, 8, generator=generator)]

    def reference_forward(self, x_t, t, text):
        context, vace = text
        return self.diffusion_model(x_t.to(self.dtype), self.objective().model_timestep(t), context.to(self.dtype),
                                    vace_context=vace[:, None].to(self.dtype), vace_strength=[VACE_STRENGTH])


def vace_context(frames: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``WAN21_Vace.extra_conds`` for one control: the node's ``vace_frames`` scaled, then its ``vace_mask``."""
    return torch.cat([scaled_latents(frames), mask.float()], dim=1)


# --- Fun-Control ----------------------------------------------------------------------------------
class WanFunControlAdapter(WanI2VAdapter):
    arch = "wan_fun_control"
    spec = WAN_FUN_CONTROL_SPEC
    needs_control = True
    video_control = True
    concat_channels = 32     # control latent 16 + start-image latent 16

    takes_control_start_image = True

    @classmethod
    def check_config(cls, cfg, file):
        super().check_config(cfg, file)
        if cfg.control_start_image is False and cfg.clip_vision:
            raise ConfigError("CLIP vision encodes the start image, and control_start_image = false gives none; "
                              "remove [model] clip_vision or set control_start_image = true", file=file,
                              key="model.control_start_image")

    @property
    def start_image(self) -> bool:
        """``[model] control_start_image``: the clip's first frame as the node's start_image (default true)."""
        return self.cfg.control_start_image is not False

    def conditioning_options(self):
        return {} if self.start_image else {"start_image": False}   # the default's cache keys stay as they were

    def encode_conditioning(self, vae, media, control):
        if self.start_image and media.shape[0] < 2:
            raise ModelError(f"{self.arch} trains on videos only while the first frame is given with the control; "
                             "this dataset has a still image: set [model] control_start_image = false to train "
                             "without a start image (stills too), or give clips")
        _frames_check(self.arch, media, control)
        frames, height, width = media.shape[:3]
        positive = self._to_video(vae, _no_text(), _no_text(), width, height, frames, control,
                                  media[:1] if self.start_image else None)[0][0][1]
        out = {"concat": scaled_latents(positive["concat_latent_image"])[0].cpu()}
        if "clip_fea" in self.conditioning_fields:
            out["clip_fea"] = self.encode_clip_vision(media[:1])
        return out

    def control_conditioning(self, vae, positive, negative, width, height, frames, control, start_image=None):
        """Samples: WanFunControlToVideo as training calls it, with CLIPVisionEncode's output of the start image
        where [model] clip_vision names a file (training caches those tokens apart); no frames to trim."""
        vision = self.clip_vision_output(start_image) if start_image is not None and self.cfg.clip_vision else None
        return (*self._to_video(vae, positive, negative, width, height, frames, control, start_image, vision), 0)

    @staticmethod
    def _to_video(vae, positive, negative, width, height, frames, control, start_image, vision=None) -> tuple:
        """ComfyUI's WanFunControlToVideo: (positive, negative, latent)."""
        return tuple(nodes_wan().WanFunControlToVideo.execute(positive, negative, vae, width, height, frames, 1,
                                                               start_image=start_image, clip_vision_output=vision,
                                                               control_video=control).result)
