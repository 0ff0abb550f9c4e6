# SPDX-License-Identifier: GPL-3.0-or-later
"""Flux 2 Klein (4B and 9B) through ComfyUI's Flux2 class: Flux 2 dev's network (``flux2.py``) at other widths and
depths, with a Qwen3 text encoder in place of Mistral.

ComfyUI builds Klein from the same ``comfy.supported_models.Flux2`` as dev; its detection reads the widths from
the weights: Klein 4B is 3072 wide (24 heads of 128; 5 double, 20 single blocks) and reads Qwen3-4B, Klein 9B is
4096 wide (32 heads; 8 double, 24 single blocks) and reads Qwen3-8B. Neither has a guidance embedding (the base
models, the ones to train, sample with real CFG). The text is the hidden states of the LLM's layers 9, 18 and 27
side by side (3 x 2560 or 3 x 4096 wide; ComfyUI's ``klein_te``), after Klein's chat template, padded by its
tokenizer to at least 512 tokens (pad-token states, which the network attends to as ComfyUI feeds them); the
network left-pads shorter text to 512 (``model_base.Flux2``), as for dev. Layers, objective (rectified flow,
shift 3 unless the [model] table sets ``shift``), LoRA targets and the latent format (Flux 2's VAE) are dev's.

ComfyUI loads Klein's text encoders from 0.9.2 on (``Flux2.clip_target``, ``CLIPType.FLUX2``); an older ComfyUI
builds the network but cannot encode its captions, so the type is refused there by name (``spec.min_comfyui``).
diffusion-pipe's config names Klein ``type = 'flux2'`` and tells the variant from the file (its ``img_in`` width);
``compat.file_type`` maps that config here by the file's header (``claims_file``).
"""
from __future__ import annotations

import dataclasses

from .encoders import TextEncoderKind, comfy_llm_config
from .flux2 import FLUX2_DEV, FLUX2_SPEC, KLEIN_TEXT_WIDTHS, Flux2Adapter
from .spec import comfy_text_model

# Klein as ComfyUI's detection gives it (Flux 2's fixed fields; widths and depths from the weights)
_KLEIN = {**FLUX2_DEV, "guidance_embed": False}
FLUX2_KLEIN_9B = {**_KLEIN, "hidden_size": 4096, "num_heads": 32, "depth": 8, "depth_single_blocks": 24,
                  "context_in_dim": 12288}
FLUX2_KLEIN_4B = {**_KLEIN, "hidden_size": 3072, "num_heads": 24, "depth": 5, "depth_single_blocks": 20,
                  "context_in_dim": 7680}
# Klein's structure at width 256 (4 heads of 64), 2 + 2 blocks, taking the tiny Qwen3-8B's 3 x 64 wide text; ComfyUI
# pins heads of 128, so tiny files carry this config in their metadata
FLUX2_KLEIN_TINY = {**FLUX2_KLEIN_9B, "hidden_size": 256, "num_heads": 4, "axes_dim": [16, 16, 16, 16],
                    "context_in_dim": 192, "depth": 2, "depth_single_blocks": 2}
MIN_COMFYUI = "0.9.2"   # Comfy-Org/ComfyUI 3b832231 "Flux2 Klein support", released in v0.9.2 (2026-01-15)
# the tensors of a Flux 2 file (ComfyUI's layout, bare or under a checkpoint's prefix) that tell Klein apart
_FLUX2_MARK, _TEXT_IN = "double_stream_modulation_img.lin.weight", "txt_in.weight"


def klein_config(size: str) -> dict:
    return dict(FLUX2_KLEIN_9B if size == "full" else FLUX2_KLEIN_TINY)


def reads_qwen3(unet_config: dict) -> bool:
    return unet_config.get("context_in_dim") in KLEIN_TEXT_WIDTHS


# Qwen3-8B (Klein 9B; ComfyUI 0.9.2 on, tokenizer shipped with ComfyUI): Klein reads the hidden states of layers
# 9, 18 and 27, so the tiny one keeps 28 layers at width 64 with the real vocabulary (the chat template's special
# ids sit near its end); the tiny Klein takes its 3 x 64 wide output
QWEN3_8B = TextEncoderKind("Qwen3-8B", comfy_llm_config("Qwen3_8BConfig"),
                           {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 28,
                            "num_attention_heads": 2, "num_key_value_heads": 1},
                           comfy_text_model("comfy.text_encoders.llama:Qwen3_8B"), "QWEN3_8B")


FLUX2_KLEIN_SPEC = dataclasses.replace(
    FLUX2_SPEC, title="Flux 2 Klein", unet_config=klein_config, accepts=reads_qwen3,
    # the tiny files and the "full" size are Klein 9B's; Klein 4B's Qwen3-4B is the other set ComfyUI reads
    text_encoders=("qwen3_8b",), text_encoder_alternatives=(("qwen3_4b",),), clip_type="FLUX2",
    text_encoder_kinds={"qwen3_8b": QWEN3_8B},
    text_encoder_types=("flux2",), example_file="flux-2-klein-base-4b.safetensors", min_comfyui=MIN_COMFYUI)


class Flux2KleinAdapter(Flux2Adapter):
    arch = "flux2_klein"
    dp_file_of = "flux2"
    spec = FLUX2_KLEIN_SPEC
    text_fields = ("qwen3",)

    @staticmethod
    def claims_file(shapes: dict, metadata: dict) -> bool:
        """Whether a diffusion-model file's header (no weights read) is Klein's: PipeTrain's own file naming it, or
        Flux 2's shared-modulation layout with a Qwen3-wide text input (ComfyUI's detection, on the header alone)."""
        from .loading import META_ARCH, META_UNET

        if META_UNET in metadata:
            return metadata.get(META_ARCH) == Flux2KleinAdapter.arch
        prefixes = {k[:-len(_FLUX2_MARK)] for k in shapes if k.endswith(_FLUX2_MARK)}
        return any(len(shapes.get(p + _TEXT_IN, ())) == 2 and shapes[p + _TEXT_IN][1] in KLEIN_TEXT_WIDTHS
                   for p in prefixes)
