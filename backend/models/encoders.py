# SPDX-License-Identifier: GPL-3.0-or-later
"""Text-encoder and CLIP-vision file kinds, shared between architectures (an ``ArchSpec`` names its kinds): each
kind's ComfyUI config and class, the overrides of its tiny files and the tensors its files carry besides the
weights. Tiny tokenizers, where ComfyUI ships none to copy, are made by ``tiny_tokenizers.py``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..host.patches_comfyui import mistral_tokenizer_for_transformers5
from .spec import comfy_object, comfy_text_model
from .tiny_tokenizers import (GEMMA2_TINY_SPIECE, GEMMA2_TINY_VOCAB, MISTRAL_TINY_VOCAB, UMT5_TINY_SPIECE,
                              UMT5_TINY_VOCAB, mistral_tiny_tekken)


@dataclass(frozen=True)
class TextEncoderKind:
    """A text-encoder file kind. Its key in ``TEXT_ENCODERS`` is ComfyUI's name for the encoder (the
    ``name`` of its ``SD1ClipModel``: ``clip_l``, ``t5xxl``, ``qwen25_7b``, ...), which is also the
    ``<name>_model_config`` option that tiny files' configs travel in."""
    title: str                                   # "CLIP-L"
    config: str | Callable[[], dict]             # ComfyUI's JSON config (relative to its root), or a function
    tiny: dict                                   # overrides for the tiny size (output width stays real)
    build: Callable[[dict], torch.nn.Module]     # config -> the module whose state dict is the file (meta device)
    te_model: str                                # comfy.sd.TEModel that ComfyUI's detection gives a real file
    # extra tensors a file of this kind carries besides the weights, e.g. a tokenizer (name -> () -> tensor);
    # they reach ComfyUI's tokenizer as ``tokenizer_data``, as comfy.sd.load_clip hands them over
    extras: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    # submodules tiny files leave out: ComfyUI builds them but encoding text never runs them (a VL model's
    # vision tower); loading a tiny file leaves them as ComfyUI built them
    tiny_omits: tuple[str, ...] = ()
    # the model option ComfyUI's class reads a config from, where it is not "<key>_model_config" (ComfyUI's
    # byT5 glyph encoder names no model, so it reads the unnamed "_model_config")
    model_option: str = ""
    # other comfy.sd.TEModel names ComfyUI's detection gives real files of this kind (e.g. a pruned one)
    also_detected_as: tuple[str, ...] = ()
    # ComfyUI's name for the encoder where the key must differ (ComfyUI names both T5-XXL kinds "t5xxl")
    comfy_name: str = ""
    # the patches_comfyui function ComfyUI needs before it can build this kind's tokenizer (``loading.py`` runs it)
    comfy_patch: Callable[[], object] | None = None


CLIP_TEXT_MODEL = comfy_text_model("comfy.clip_model:CLIPTextModel")
T5_MODEL = comfy_text_model("comfy.text_encoders.t5:T5")


def comfy_llm_config(name: str):
    """``config`` for an LLM text encoder: ComfyUI's dataclass config ``comfy.text_encoders.llama.<name>``."""
    def config() -> dict:
        import dataclasses
        return dataclasses.asdict(comfy_object(f"comfy.text_encoders.llama:{name}")())
    return config


# Output widths stay real: CLIP-L 768, CLIP-H 1024, CLIP-G 1280, T5 / UMT5 4096 (the diffusion models' context widths).
TEXT_ENCODERS: dict[str, TextEncoderKind] = {
    "clip_l": TextEncoderKind("CLIP-L", "comfy/sd1_clip_config.json",
                              {"num_hidden_layers": 3, "intermediate_size": 256}, CLIP_TEXT_MODEL, "CLIP_L"),
    "clip_g": TextEncoderKind("CLIP-G", "comfy/clip_config_bigg.json",
                              {"num_hidden_layers": 3, "intermediate_size": 256}, CLIP_TEXT_MODEL, "CLIP_G"),
    # SD 2.x's OpenCLIP ViT-H/14 text tower (ComfyUI reads its penultimate layer)
    "clip_h": TextEncoderKind("OpenCLIP-H", "comfy/text_encoders/sd2_clip_config.json",
                              {"num_hidden_layers": 3, "intermediate_size": 256}, CLIP_TEXT_MODEL, "CLIP_H"),
    "t5xxl": TextEncoderKind("T5-XXL", "comfy/text_encoders/t5_config_xxl.json",
                             {"num_layers": 2, "num_heads": 4, "d_ff": 256}, T5_MODEL, "T5_XXL"),
    # Cosmos' T5-XXL (the original T5 v1.0: ReLU, 1024 wide output); ComfyUI calls it t5xxl too
    "t5xxl_old": TextEncoderKind("T5-XXL (Cosmos)", "comfy/text_encoders/t5_old_config_xxl.json",
                                 {"num_layers": 2, "num_heads": 4, "d_ff": 256}, T5_MODEL, "T5_XXL_OLD",
                                 comfy_name="t5xxl"),
    "umt5xxl": TextEncoderKind("UMT5-XXL", "comfy/text_encoders/umt5_config_xxl.json",
                               {"num_layers": 2, "num_heads": 4, "d_ff": 256, "vocab_size": UMT5_TINY_VOCAB}, T5_MODEL,
                               "T5_XXL", extras={"spiece_model": UMT5_TINY_SPIECE}),
    # ACE-Step's UMT5-base (768 wide; ComfyUI's AceT5Model): tiny files keep the width with 2 narrow layers and
    # the tiny UMT5 tokenizer. ComfyUI's UMT5BaseModel names no model, so it reads the unnamed "_model_config"
    "umt5_base": TextEncoderKind("UMT5-base", "comfy/text_encoders/umt5_config_base.json",
                                 {"num_layers": 2, "num_heads": 4, "d_ff": 256, "vocab_size": UMT5_TINY_VOCAB},
                                 T5_MODEL, "T5_BASE", extras={"spiece_model": UMT5_TINY_SPIECE},
                                 model_option="_model_config", comfy_name="umt5base"),
    # AuraFlow's Pile-T5-XL (tokenizer shipped with ComfyUI): the tiny one is 256 wide (the real 2048-wide
    # vocabulary table alone would be 260 MB); the tiny AuraFlow takes that width
    "pile_t5xl": TextEncoderKind("Pile-T5-XL", "comfy/text_encoders/t5_pile_config_xl.json",
                                 {"num_layers": 2, "num_heads": 4, "d_ff": 256, "d_model": 256}, T5_MODEL, "T5_XL"),
    # Qwen2.5-VL-7B (Qwen-Image): the tiny one keeps the real vocabulary (the chat template's special ids sit
    # near its end) at width 64, so the tiny Qwen-Image takes that width; tiny files leave out the vision tower
    # (fixed at 1280 x 32 layers in ComfyUI, 0.6B parameters), which text-only encoding never runs
    # (4 layers: HunyuanImage 2.1 / HunyuanVideo 1.5 read the third-last one)
    "qwen25_7b": TextEncoderKind("Qwen2.5-VL-7B", comfy_llm_config("Qwen25_7BVLI_Config"),
                                 {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                                  "num_attention_heads": 2, "num_key_value_heads": 1},
                                 comfy_text_model("comfy.text_encoders.llama:Qwen25_7BVLI"), "QWEN25_7B",
                                 tiny_omits=("visual",)),
    # Qwen2.5-VL-3B's language model (OmniGen2; tokenizer shipped with ComfyUI): the tiny one keeps the real
    # vocabulary (the chat template's special ids sit near its end) at width 64, so the tiny OmniGen2 takes it
    "qwen25_3b": TextEncoderKind("Qwen2.5-VL-3B", comfy_llm_config("Qwen25_3BConfig"),
                                 {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                  "num_attention_heads": 2, "num_key_value_heads": 1},
                                 comfy_text_model("comfy.text_encoders.llama:Qwen25_3B"), "QWEN25_3B"),
    # Qwen3-4B (Z-Image; tokenizer shipped with ComfyUI): the tiny one keeps the real vocabulary (the chat
    # template's special ids sit near its end) at width 64, so the tiny Z-Image takes that width
    "qwen3_4b": TextEncoderKind("Qwen3-4B", comfy_llm_config("Qwen3_4BConfig"),
                                {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                                 "num_attention_heads": 2, "num_key_value_heads": 1},
                                comfy_text_model("comfy.text_encoders.llama:Qwen3_4B"), "QWEN3_4B"),
    # Gemma-2-2B (Lumina 2): real files carry their SentencePiece model; the tiny one keeps the real width 2304
    # with a 2000-piece tokenizer of Gemma's special ids
    "gemma2_2b": TextEncoderKind("Gemma-2-2B", comfy_llm_config("Gemma2_2B_Config"),
                                 {"num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
                                  "intermediate_size": 256, "vocab_size": GEMMA2_TINY_VOCAB},
                                 comfy_text_model("comfy.text_encoders.llama:Gemma2_2B"), "GEMMA_2_2B",
                                 extras={"spiece_model": GEMMA2_TINY_SPIECE}),
    # HunyuanVideo's LLaVA-Llama-3-8B text model: the tiny one keeps the real vocabulary (the chat template's
    # ids sit at its end) at width 64 with 4 layers (ComfyUI reads the third-last layer); the tiny HunyuanVideo
    # takes that width
    "llama": TextEncoderKind("LLaVA-Llama-3-8B", comfy_llm_config("Llama2Config"),
                             {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                              "num_attention_heads": 1, "num_key_value_heads": 1},
                             comfy_text_model("comfy.text_encoders.llama:Llama2"), "LLAMA3_8"),
    # byT5-small glyph encoder (HunyuanVideo 1.5, HunyuanImage 2.1): the diffusion models fix its width 1472,
    # so the tiny one keeps it (and the 1510-byte vocabulary) with 2 narrow layers
    "byt5_small": TextEncoderKind("byT5-small glyph", "comfy/text_encoders/byt5_config_small_glyph.json",
                                  {"num_layers": 2, "num_heads": 2, "d_kv": 32, "d_ff": 128}, T5_MODEL,
                                  "BYT5_SMALL_GLYPH", model_option="_model_config"),
    # Mistral-Small-3.1-24B (Flux 2): ComfyUI reads the hidden states of layers 10, 20 and 30, so the tiny one
    # keeps 30 layers (like ComfyUI's pruned Flux 2 file) at width 64 with a byte-level tekken tokenizer; the
    # tiny Flux 2 takes its 3 x 64 wide output
    "mistral3_24b": TextEncoderKind("Mistral-Small-3.1-24B", comfy_llm_config("Mistral3Small24BConfig"),
                                    {"vocab_size": MISTRAL_TINY_VOCAB, "hidden_size": 64, "intermediate_size": 128,
                                     "num_hidden_layers": 30, "num_attention_heads": 1, "num_key_value_heads": 1,
                                     "final_norm": False},
                                    comfy_text_model("comfy.text_encoders.llama:Mistral3Small24B"), "MISTRAL3_24B",
                                    extras={"tekken_model": mistral_tiny_tekken},
                                    comfy_patch=mistral_tokenizer_for_transformers5,
                                    also_detected_as=("MISTRAL3_24B_PRUNED_FLUX2",)),
}


def kinds() -> dict[str, TextEncoderKind]:
    """Every text-encoder kind by name: the shared ones above and those a model declares in its own spec."""
    from .registry import declared_kinds
    return {**TEXT_ENCODERS, **declared_kinds("text_encoder_kinds")}


def kind(name: str) -> TextEncoderKind:
    """The text-encoder kind ``name`` (``kinds``)."""
    return TEXT_ENCODERS[name] if name in TEXT_ENCODERS else kinds()[name]


# ComfyUI's detection calls UMT5 files T5_XXL too; UMT5 has a relative-attention bias in every layer
UMT5_MARKER = "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"


# CLIP-vision files ([model] clip_vision; Wan 2.1 i2v's clip_vision_h): ComfyUI's ViT-H/14 config, and the
# overrides of tiny files (real width 1280 and 257 tokens; their config travels in the file's metadata)
CLIP_VISION_H_CONFIG = "comfy/clip_vision_config_h.json"
CLIP_VISION_TINY = {"num_hidden_layers": 2, "intermediate_size": 256}
# the module whose state dict is a CLIP-vision file (config -> meta-device module)
clip_vision_model = comfy_text_model("comfy.clip_model:CLIPVisionModelProjection")
