# SPDX-License-Identifier: GPL-3.0-or-later
"""SD 1.x and SD 2.x through ComfyUI's ``comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel``.

Both are the UNet SDXL is (``sdxl.py``), one level deeper and without the ADM vector, so the pipeline layers are
SDXL's with a first layer that embeds the timestep alone:

    UNetInput        x_t, emb = time_embed(t)  ->  (emb, context, x_t)
    InputBlock  x12  input_blocks[i]   (input_blocks[0] replaces x_t, the others push a skip)
    MiddleBlock      middle_block
    OutputBlock x12  output_blocks[i]  pops h and one skip
    SDXLOutput       out(h)

The two differ where ComfyUI's ``supported_models.SD15`` / ``SD20`` differ: SD 1.x reads CLIP-L (768 wide, 8
heads, 1x1-convolution projections in its SpatialTransformers), SD 2.x OpenCLIP-H's penultimate layer (1024 wide,
64-channel heads, linear projections). Whether a model predicts eps or v is ComfyUI's ``model_sampling``: SD 1.x
and SD 2.x-base sample as eps, SD 2.x 768-v as v (ComfyUI's ``SD20.model_type`` tells it from the weights); the
objective follows it (``SDXLAdapter.objective``), ``v_pred = true`` forces v.

LoRA goes on the linears of the 16 SpatialTransformers (attention and feed-forward; on SD 2.x also the linear
``proj_in`` / ``proj_out``), kohya's "Transformer2DModel" targets; the 1x1 convolutions of SD 1.x are left
(PipeTrain's adapters wrap linears), and so are the ResBlocks.
"""
from __future__ import annotations

import torch

from .carry import TupleLayer
from .sdxl import REFERENCE_TEXT_TOKENS, SDXLAdapter, UNetInput
from .spec import ArchSpec, comfy_diffusion_model

# The SpatialTransformer of every SD 1.x / 2.x UNet block that has one: input levels 0-2, middle, output levels 2-0.
SD_TRANSFORMERS = (
    "input_blocks.1.1", "input_blocks.2.1", "input_blocks.4.1", "input_blocks.5.1", "input_blocks.7.1",
    "input_blocks.8.1", "middle_block.1", *(f"output_blocks.{i}.1" for i in range(3, 12)),
)
# The SD 1.x UNet as comfy.model_detection derives it from the published weights, with SD15's head count.
SD15_UNET_FULL = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
    "legacy": False, "adm_in_channels": None, "in_channels": 4, "model_channels": 320,
    "num_res_blocks": [2, 2, 2, 2], "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "channel_mult": [1, 2, 4, 4],
    "transformer_depth_middle": 1, "use_linear_in_transformer": False, "context_dim": 768,
    "num_heads": 8, "num_head_channels": -1,
    "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    "use_temporal_attention": False, "use_temporal_resblock": False,
}
# SD 2.x (2.0 / 2.1, 512 base and 768-v): the same layout, OpenCLIP-H's width, linear projections, 64-wide heads.
SD2_UNET_FULL = {**SD15_UNET_FULL, "use_linear_in_transformer": True, "context_dim": 1024,
                 "num_heads": -1, "num_head_channels": 64}
# Tiny: the same layout (4 levels, 16 transformers) at 32 channels; the text width stays the encoder's. ComfyUI
# matches only the published widths, so tiny files carry these in their metadata.
SD15_UNET_TINY = {**SD15_UNET_FULL, "model_channels": 32, "num_heads": 2}
SD2_UNET_TINY = {**SD2_UNET_FULL, "model_channels": 32, "num_head_channels": 16}

# ComfyUI's SD20.model_type takes a 4-channel SD 2.x UNet for v-prediction (768-v) when this bias is spread wider
# than 0.09 (it is in the published 768-v weights); written so, random files are detected as 768-v models
SD2_V_PREDICTION_MARKER = "output_blocks.11.1.transformer_blocks.0.norm1.bias"


def _sizes(tiny: dict, full: dict):
    def unet_config(size: str) -> dict:
        return dict(tiny if size in ("micro", "tiny") else full)
    return unet_config


build_sd_unet = comfy_diffusion_model("comfy.ldm.modules.diffusionmodules.openaimodel:UNetModel")

SD15_SPEC = ArchSpec(
    title="SD 1.x", comfy_configs=("SD15",), unet_config=_sizes(SD15_UNET_TINY, SD15_UNET_FULL), build=build_sd_unet,
    detected_sizes=("full",), text_encoders=("clip_l",), clip_type="STABLE_DIFFUSION", vae="kl4",
    example_file="an SD 1.5 UNet or checkpoint")
SD2_SPEC = ArchSpec(
    title="SD 2.x", comfy_configs=("SD20",), unet_config=_sizes(SD2_UNET_TINY, SD2_UNET_FULL), build=build_sd_unet,
    detected_sizes=("full",), text_encoders=("clip_h",), clip_type="STABLE_DIFFUSION", vae="kl4",
    example_file="an SD 2.1 768-v UNet or checkpoint", diffusion_model_init={SD2_V_PREDICTION_MARKER: "normal:0.2"})


class SD15Adapter(SDXLAdapter):
    """SDXL's layers and objective (``sdxl.py``), one caption tensor and no ADM vector."""
    dp_diffusers_folder = True
    arch = "sd15"
    spec = SD15_SPEC
    latent_format = "SD15"
    lora_block_prefixes = SD_TRANSFORMERS
    text_fields = ("cond",)
    spatial_multiple = 64        # latent sides divisible by 8: the UNet's three downsamplings stay exact
    reference_latent = (64, 64)  # layer costs at the native 512x512

    def input_layer(self, dm) -> TupleLayer:
        return UNetInput(dm, self.objective(), self.dtype)

    def probe_latent(self, generator, size=(8, 8)):
        # at least 16x16: after three downsamplings an 8x8 latent is one position in the middle block, whose
        # self-attention (a softmax over one key) then gives its q and k projections no gradient to check
        return super().probe_latent(generator, tuple(max(side, 16) for side in size))

    def probe_text(self, generator):
        context_dim = self.diffusion_model.middle_block[1].transformer_blocks[0].attn2.to_k.in_features
        return [torch.randn(1, REFERENCE_TEXT_TOKENS, context_dim, generator=generator)]

    def reference_forward(self, x_t, t, text):
        (cond,) = text
        return self.diffusion_model(x_t.to(self.dtype), t, context=cond.to(self.dtype))


class SD2Adapter(SD15Adapter):
    arch = "sd2"
    spec = SD2_SPEC
    reference_latent = (96, 96)  # layer costs at 2.x 768-v's native 768x768

