# SPDX-License-Identifier: GPL-3.0-or-later
"""What files an architecture uses and how ComfyUI recognises them -- the facts ``loading.py`` and
``tiny.py`` work from, so that neither names an architecture.

Each adapter class carries one ``ArchSpec`` (its ``spec`` attribute, defined beside the adapter): which
``comfy.supported_models`` classes ComfyUI's detection gives for it, its diffusion-model config per size
(``micro`` / ``tiny`` / ``full``) and the ComfyUI class built from one, its text-encoder kinds and VAE kind.
Text encoders and VAEs are shared between architectures, so their kinds are the two tables below.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

SIZES = ("micro", "tiny", "full")


@dataclass(frozen=True)
class ArchSpec:
    title: str                                   # for messages: "Flux", "SDXL", ...
    comfy_configs: tuple[str, ...]               # comfy.supported_models classes ComfyUI's detection gives
    unet_config: Callable[[str], dict]           # size -> ComfyUI's unet_config (the diffusion model's kwargs)
    build: Callable[[dict], torch.nn.Module]     # unet_config -> the ComfyUI network on the meta device
    detected_sizes: tuple[str, ...]              # sizes ComfyUI's detection recognises from the weights alone;
    #                                              the others carry their config in the file's metadata
    text_encoders: tuple[str, ...]               # text-encoder kinds (TEXT_ENCODERS), one file each
    clip_type: str                               # comfy.sd.CLIPType name for real text-encoder files
    clip_target: Callable[[], object]            # ComfyUI's ClipTarget (tokenizer + model) for tiny ones
    vae: str                                     # VAE kind (VAES)
    example_file: str = ""                       # named in "not recognised" messages
    # where architectures share a ComfyUI class (Wan t2v and Wan 2.2 i2v are both WAN21_T2V): whether the
    # unet_config ComfyUI detected from a file is this one's
    accepts: Callable[[dict], bool] | None = None
    # its captions are read with an image (Qwen-Image-Edit): tiny text-encoder files keep what ``tiny_omits``
    # leaves out of the others (the VL model's vision tower)
    text_encoders_read_images: bool = False


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


def _comfy_object(path: str):
    """The ComfyUI object named ``module:name``, e.g. ``comfy.text_encoders.t5:T5``."""
    import importlib

    from ..runtime import ensure_comfyui
    ensure_comfyui()
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _comfy_text_model(path: str):
    """``build`` for a ComfyUI text-model class taking (config, dtype, device, operations), e.g.
    ``comfy.text_encoders.t5:T5``."""
    def build(config: dict) -> torch.nn.Module:
        return _comfy_object(path)(config, torch.float32, "meta", _comfy_object("comfy.ops:disable_weight_init"))
    return build


def comfy_diffusion_model(path: str):
    """``ArchSpec.build`` for a ComfyUI diffusion-model class taking its unet_config as keyword arguments
    beside (device, operations), e.g. ``comfy.ldm.wan.model:WanModel``."""
    def build(config: dict) -> torch.nn.Module:
        return _comfy_object(path)(device="meta", operations=_comfy_object("comfy.ops:disable_weight_init"), **config)
    return build


def comfy_clip_target(tokenizer: str, model: str):
    """``ArchSpec.clip_target`` from two ComfyUI names: the tokenizer class and the text-model class, or a
    factory that returns one when the name ends in ``()`` (``comfy.text_encoders.wan:te()``)."""
    def target():
        clip = _comfy_object(model.removesuffix("()"))
        return _comfy_object("comfy.supported_models_base:ClipTarget")(_comfy_object(tokenizer),
                                                                       clip() if model.endswith("()") else clip)
    return target


CLIP_TEXT_MODEL = _comfy_text_model("comfy.clip_model:CLIPTextModel")
T5_MODEL = _comfy_text_model("comfy.text_encoders.t5:T5")


def _qwen25_7b_config() -> dict:
    """ComfyUI's Qwen2.5-VL-7B language-model config (``comfy.text_encoders.llama.Qwen25_7BVLI_Config``)."""
    import dataclasses

    from ..runtime import ensure_comfyui
    ensure_comfyui()
    from comfy.text_encoders.llama import Qwen25_7BVLI_Config
    return dataclasses.asdict(Qwen25_7BVLI_Config())


def _tiny_spiece(vocab_size: int, pad_id: int, eos_id: int, unk_id: int, bos_id: int = -1):
    """``extras`` maker for a ``spiece_model`` tensor (a SentencePiece model as uint8, as real files carry it and
    ComfyUI's tokenizer reads it from the file) where the real one is not shipped with ComfyUI: a unigram model
    of ``vocab_size`` pieces with the encoder's own special ids (-1: none),
    trained deterministically on the words of the T5-pile tokenizer that ComfyUI does ship."""
    def spiece() -> torch.Tensor:
        import io

        import sentencepiece

        from ..runtime import ensure_comfyui
        pile = sentencepiece.SentencePieceProcessor(
            model_file=str(ensure_comfyui() / "comfy/text_encoders/t5_pile_tokenizer/tokenizer.model"))
        words = [w for w in (pile.id_to_piece(i).replace("\u2581", "") for i in range(pile.get_piece_size()))
                 if w.isascii() and w.isalpha()]
        out = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(words), model_writer=out, vocab_size=vocab_size, model_type="unigram",
            pad_id=pad_id, eos_id=eos_id, bos_id=bos_id, unk_id=unk_id, num_threads=1, minloglevel=2)
        return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)
    return spiece


UMT5_TINY_VOCAB = 2000
# UMT5's special ids: pad 0, end 1, unknown 2
UMT5_TINY_SPIECE = _tiny_spiece(UMT5_TINY_VOCAB, pad_id=0, eos_id=1, unk_id=2)


def _comfy_llm_config(name: str):
    """``config`` for an LLM text encoder: ComfyUI's dataclass config ``comfy.text_encoders.llama.<name>``."""
    def config() -> dict:
        import dataclasses

        from ..runtime import ensure_comfyui
        ensure_comfyui()
        import comfy.text_encoders.llama
        return dataclasses.asdict(getattr(comfy.text_encoders.llama, name)())
    return config


GEMMA2_TINY_VOCAB = 2000
# Gemma's special ids: pad 0, end 1, start 2, unknown 3
GEMMA2_TINY_SPIECE = _tiny_spiece(GEMMA2_TINY_VOCAB, pad_id=0, eos_id=1, bos_id=2, unk_id=3)


# Mistral's first special tokens, at their real ids (Flux 2's template uses <s>, [INST], [/INST], [SYSTEM_PROMPT],
# [/SYSTEM_PROMPT]; ComfyUI pads with <pad>, id 11), and tekken's pre-tokenizer pattern
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                    "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                    "[TOOL_CONTENT]")
TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                  r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
MISTRAL_TINY_VOCAB = len(MISTRAL_SPECIALS) + 256


def _mistral_tiny_tekken() -> torch.Tensor:
    """The ``tekken_model`` tensor real Mistral files for Flux 2 carry (tekken.json as bytes; ComfyUI's Flux 2
    tokenizer reads it from the file). Mistral's own is not shipped with ComfyUI, so tiny files get a byte-level
    one: Mistral's first 20 special tokens at their real ids, then the 256 bytes."""
    import base64
    import json

    vocab = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": None} for i in range(256)]
    specials = [{"rank": i, "token_str": name, "is_control": True} for i, name in enumerate(MISTRAL_SPECIALS)]
    tekken = {"config": {"pattern": TEKKEN_PATTERN, "num_vocab_tokens": MISTRAL_TINY_VOCAB,
                         "default_vocab_size": MISTRAL_TINY_VOCAB,
                         "default_num_special_tokens": len(MISTRAL_SPECIALS), "version": "v7"},
              "vocab": vocab, "special_tokens": specials}
    return torch.frombuffer(bytearray(json.dumps(tekken).encode()), dtype=torch.uint8)


# Output widths stay real: CLIP-L 768, CLIP-G 1280, T5 / UMT5 4096 (the diffusion models' context widths).
TEXT_ENCODERS: dict[str, TextEncoderKind] = {
    "clip_l": TextEncoderKind("CLIP-L", "comfy/sd1_clip_config.json",
                              {"num_hidden_layers": 3, "intermediate_size": 256}, CLIP_TEXT_MODEL, "CLIP_L"),
    "clip_g": TextEncoderKind("CLIP-G", "comfy/clip_config_bigg.json",
                              {"num_hidden_layers": 3, "intermediate_size": 256}, CLIP_TEXT_MODEL, "CLIP_G"),
    "t5xxl": TextEncoderKind("T5-XXL", "comfy/text_encoders/t5_config_xxl.json",
                             {"num_layers": 2, "num_heads": 4, "d_ff": 256}, T5_MODEL, "T5_XXL"),
    # Cosmos' T5-XXL (the original T5 v1.0: ReLU, 1024 wide output); ComfyUI calls it t5xxl too
    "t5xxl_old": TextEncoderKind("T5-XXL (Cosmos)", "comfy/text_encoders/t5_old_config_xxl.json",
                                 {"num_layers": 2, "num_heads": 4, "d_ff": 256}, T5_MODEL, "T5_XXL_OLD",
                                 comfy_name="t5xxl"),
    "umt5xxl": TextEncoderKind("UMT5-XXL", "comfy/text_encoders/umt5_config_xxl.json",
                               {"num_layers": 2, "num_heads": 4, "d_ff": 256, "vocab_size": UMT5_TINY_VOCAB}, T5_MODEL,
                               "T5_XXL", extras={"spiece_model": UMT5_TINY_SPIECE}),
    # AuraFlow's Pile-T5-XL (tokenizer shipped with ComfyUI): the tiny one is 256 wide (the real 2048-wide
    # vocabulary table alone would be 260 MB); the tiny AuraFlow takes that width
    "pile_t5xl": TextEncoderKind("Pile-T5-XL", "comfy/text_encoders/t5_pile_config_xl.json",
                                 {"num_layers": 2, "num_heads": 4, "d_ff": 256, "d_model": 256}, T5_MODEL, "T5_XL"),
    # Qwen2.5-VL-7B (Qwen-Image): the tiny one keeps the real vocabulary (the chat template's special ids sit
    # near its end) at width 64, so the tiny Qwen-Image takes that width; tiny files leave out the vision tower
    # (fixed at 1280 x 32 layers in ComfyUI, 0.6B parameters), which text-only encoding never runs
    # (4 layers: HunyuanImage 2.1 / HunyuanVideo 1.5 read the third-last one)
    "qwen25_7b": TextEncoderKind("Qwen2.5-VL-7B", _qwen25_7b_config,
                                 {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                                  "num_attention_heads": 2, "num_key_value_heads": 1},
                                 _comfy_text_model("comfy.text_encoders.llama:Qwen25_7BVLI"), "QWEN25_7B",
                                 tiny_omits=("visual",)),
    # Qwen2.5-VL-3B's language model (OmniGen2; tokenizer shipped with ComfyUI): the tiny one keeps the real
    # vocabulary (the chat template's special ids sit near its end) at width 64, so the tiny OmniGen2 takes it
    "qwen25_3b": TextEncoderKind("Qwen2.5-VL-3B", _comfy_llm_config("Qwen25_3BConfig"),
                                 {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                  "num_attention_heads": 2, "num_key_value_heads": 1},
                                 _comfy_text_model("comfy.text_encoders.llama:Qwen25_3B"), "QWEN25_3B"),
    # Qwen3-4B (Z-Image; tokenizer shipped with ComfyUI): the tiny one keeps the real vocabulary (the chat
    # template's special ids sit near its end) at width 64, so the tiny Z-Image takes that width
    "qwen3_4b": TextEncoderKind("Qwen3-4B", _comfy_llm_config("Qwen3_4BConfig"),
                                {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                                 "num_attention_heads": 2, "num_key_value_heads": 1},
                                _comfy_text_model("comfy.text_encoders.llama:Qwen3_4B"), "QWEN3_4B"),
    # Gemma-2-2B (Lumina 2): real files carry their SentencePiece model; the tiny one keeps the real width 2304
    # with a 2000-piece tokenizer of Gemma's special ids
    "gemma2_2b": TextEncoderKind("Gemma-2-2B", _comfy_llm_config("Gemma2_2B_Config"),
                                 {"num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
                                  "intermediate_size": 256, "vocab_size": GEMMA2_TINY_VOCAB},
                                 _comfy_text_model("comfy.text_encoders.llama:Gemma2_2B"), "GEMMA_2_2B",
                                 extras={"spiece_model": GEMMA2_TINY_SPIECE}),
    # HunyuanVideo's LLaVA-Llama-3-8B text model: the tiny one keeps the real vocabulary (the chat template's
    # ids sit at its end) at width 64 with 4 layers (ComfyUI reads the third-last layer); the tiny HunyuanVideo
    # takes that width
    "llama": TextEncoderKind("LLaVA-Llama-3-8B", _comfy_llm_config("Llama2Config"),
                             {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                              "num_attention_heads": 1, "num_key_value_heads": 1},
                             _comfy_text_model("comfy.text_encoders.llama:Llama2"), "LLAMA3_8"),
    # byT5-small glyph encoder (HunyuanVideo 1.5, HunyuanImage 2.1): the diffusion models fix its width 1472,
    # so the tiny one keeps it (and the 1510-byte vocabulary) with 2 narrow layers
    "byt5_small": TextEncoderKind("byT5-small glyph", "comfy/text_encoders/byt5_config_small_glyph.json",
                                  {"num_layers": 2, "num_heads": 2, "d_kv": 32, "d_ff": 128}, T5_MODEL,
                                  "BYT5_SMALL_GLYPH", model_option="_model_config"),
    # Mistral-Small-3.1-24B (Flux 2): ComfyUI reads the hidden states of layers 10, 20 and 30, so the tiny one
    # keeps 30 layers (like ComfyUI's pruned Flux 2 file) at width 64 with a byte-level tekken tokenizer; the
    # tiny Flux 2 takes its 3 x 64 wide output
    "mistral3_24b": TextEncoderKind("Mistral-Small-3.1-24B", _comfy_llm_config("Mistral3Small24BConfig"),
                                    {"vocab_size": MISTRAL_TINY_VOCAB, "hidden_size": 64, "intermediate_size": 128,
                                     "num_hidden_layers": 30, "num_attention_heads": 1, "num_key_value_heads": 1,
                                     "final_norm": False},
                                    _comfy_text_model("comfy.text_encoders.llama:Mistral3Small24B"), "MISTRAL3_24B",
                                    extras={"tekken_model": _mistral_tiny_tekken},
                                    also_detected_as=("MISTRAL3_24B_PRUNED_FLUX2",)),
}
# ComfyUI's detection calls UMT5 files T5_XXL too; UMT5 has a relative-attention bias in every layer
UMT5_MARKER = "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"


@dataclass(frozen=True)
class VAEKind:
    title: str
    latent_channels: int
    build: Callable[[str], torch.nn.Module]      # size -> the module comfy.sd.VAE builds for such a file
    latent_dim: int = 2                          # comfy.sd.VAE.latent_dim: 2 images, 3 video (B, C, T, H, W)
    sized: bool = False                          # tiny files are narrower than real ones (ComfyUI reads the width)
    # where ComfyUI fixes the width instead: the ComfyUI class ("module:Class") its detection builds, and
    # size -> the constructor arguments a file of that size overrides; tiny files carry these in their metadata
    narrowed_class: str = ""
    widths: Callable[[str], dict] | None = None
    # size -> metadata ComfyUI itself reads from such a file (e.g. the LTX VAE's "config"); state-dict key ->
    # init rule ("ones" / "zeros") for tiny files where the generic one would be wrong (e.g. a latent std)
    file_metadata: Callable[[str], dict[str, str]] | None = None
    init: dict[str, str] = field(default_factory=dict)
    # tensors a file of this kind carries besides the module's state dict (name -> () -> tensor), e.g. a buffer
    # ComfyUI's detection looks for but the module does not save (the Cosmos tokenizer's wavelets)
    extras: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)


# The KL autoencoder ComfyUI builds for SD-family, SD3 and Flux VAEs.
KL_DDCONFIG = {
    "double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
    "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
}


def _kl_vae(z_channels: int, quant_conv: bool):
    def build(size: str) -> torch.nn.Module:
        from ..runtime import ensure_comfyui
        ensure_comfyui()
        from comfy.ldm.models.autoencoder import AutoencoderKL, AutoencodingEngine
        ddconfig = {**KL_DDCONFIG, "z_channels": z_channels}
        with torch.device("meta"):
            if quant_conv:  # SD1/SDXL VAE files keep quant_conv / post_quant_conv
                return AutoencoderKL(ddconfig=ddconfig, embed_dim=z_channels)
            part = "comfy.ldm.modules.diffusionmodules.model."
            return AutoencodingEngine(
                regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
                encoder_config={"target": part + "Encoder", "params": ddconfig},
                decoder_config={"target": part + "Decoder", "params": ddconfig})
    return build


WAN21_VAE_DIM = {"micro": 16, "tiny": 16, "full": 96}   # ComfyUI reads the width from decoder.head.0.gamma


def _wan21_vae(size: str) -> torch.nn.Module:
    from ..runtime import ensure_comfyui
    ensure_comfyui()
    from comfy.ldm.wan.vae import WanVAE
    with torch.device("meta"):
        return WanVAE(dim=WAN21_VAE_DIM[size], z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                      temperal_downsample=[False, True, True], dropout=0.0)


# Wan 2.2 VAE (48 channels, 16x spatial): ComfyUI builds it at (dim 160, dec_dim 256) whatever the file holds
WAN22_VAE_DIMS = {"micro": {"dim": 16, "dec_dim": 16}, "tiny": {"dim": 16, "dec_dim": 16}, "full": {}}


def _wan22_vae(size: str) -> torch.nn.Module:
    from ..runtime import ensure_comfyui
    ensure_comfyui()
    from comfy.ldm.wan.vae2_2 import WanVAE
    with torch.device("meta"):
        return WanVAE(**{"dim": 160, "dec_dim": 256, **WAN22_VAE_DIMS[size]}, z_dim=48, dim_mult=[1, 2, 4, 4],
                      num_res_blocks=2, attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0)


# LTX-Video's causal video VAE (128 channels, 32x spatial, 8x temporal). Full: the 0.9.5+ VAE ComfyUI
# recognises by its weights (its "version 2"). ComfyUI fixes its base width at 128 but reads the block layout
# from the file's "config" metadata, so the tiny one is 3 bare compress-all convolutions and one residual
# block each way (ComfyUI's detection key is the decoder's first residual block).
LTXV_VAE_TINY = {"dims": 3, "latent_channels": 128, "patch_size": 4, "norm_layer": "pixel_norm",
                 "latent_log_var": "uniform", "causal_decoder": False, "timestep_conditioning": False,
                 "blocks": [["compress_all", {}], ["compress_all", {}], ["compress_all", {}],
                            ["res_x", {"num_layers": 1}]]}


def _ltxv_vae(size: str) -> torch.nn.Module:
    from ..runtime import ensure_comfyui
    ensure_comfyui()
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE
    with torch.device("meta"):
        return VideoVAE(version=2) if size == "full" else VideoVAE(config=LTXV_VAE_TINY)


def _ltxv_vae_metadata(size: str) -> dict[str, str]:
    import json
    return {} if size == "full" else {"config": json.dumps({"vae": LTXV_VAE_TINY})}


# HunyuanVideo's causal 3-D KL VAE, HunyuanVideo 1.5's and HunyuanImage 2.1's: ComfyUI builds each at its
# published width (its ``ddconfig``); tiny files are narrower and carry their ddconfig in their metadata.
HUNYUAN_VAES = {   # kind -> (ComfyUI class, encoder/decoder module, regularizer, ddconfig, tiny overrides)
    "hunyuan_video": ("AutoencoderKL", "", "",
                      {**KL_DDCONFIG, "z_channels": 16, "conv3d": True, "time_compress": 4},
                      {"ch": 32, "num_res_blocks": 1}),
    "hunyuan_video_15": ("AutoencodingEngine", "comfy.ldm.hunyuan_video.vae_refiner", "EmptyRegularizer",
                         {"block_out_channels": [128, 256, 512, 1024, 1024], "in_channels": 3, "out_channels": 3,
                          "num_res_blocks": 2, "ffactor_spatial": 16, "ffactor_temporal": 4,
                          "downsample_match_channel": True, "upsample_match_channel": True, "z_channels": 32},
                         {"block_out_channels": [16, 32, 64, 128, 128], "num_res_blocks": 1}),
    "hunyuan_image_21": ("AutoencodingEngine", "comfy.ldm.hunyuan_video.vae", "DiagonalGaussianRegularizer",
                         {"block_out_channels": [128, 256, 512, 512, 1024, 1024], "in_channels": 3,
                          "out_channels": 3, "num_res_blocks": 2, "ffactor_spatial": 32,
                          "downsample_match_channel": True, "upsample_match_channel": True, "z_channels": 64},
                         {"block_out_channels": [32, 64, 128, 128, 256, 256], "num_res_blocks": 1}),
}


def _hunyuan_vae_widths(kind: str):
    """size -> the constructor arguments of ComfyUI's class for a file of that size (none at full size)."""
    cls, part, _, ddconfig, tiny = HUNYUAN_VAES[kind]

    def widths(size: str) -> dict:
        if size == "full":
            return {}
        params = {**ddconfig, **tiny}
        if cls == "AutoencoderKL":
            return {"ddconfig": params}
        return {"encoder_config": {"target": part + ".Encoder", "params": params},
                "decoder_config": {"target": part + ".Decoder", "params": params}}
    return widths


def _hunyuan_vae(kind: str):
    def build(size: str) -> torch.nn.Module:
        from ..runtime import ensure_comfyui
        ensure_comfyui()
        from comfy.ldm.models import autoencoder
        cls, part, regularizer, ddconfig, _ = HUNYUAN_VAES[kind]
        with torch.device("meta"):
            if cls == "AutoencoderKL":
                return autoencoder.AutoencoderKL(**{"ddconfig": ddconfig, **_hunyuan_vae_widths(kind)(size)},
                                                 embed_dim=ddconfig["z_channels"])
            full = {"encoder_config": {"target": part + ".Encoder", "params": ddconfig},
                    "decoder_config": {"target": part + ".Decoder", "params": ddconfig}}
            return autoencoder.AutoencodingEngine(
                regularizer_config={"target": "comfy.ldm.models.autoencoder." + regularizer},
                **{**full, **_hunyuan_vae_widths(kind)(size)})
    return build


def _hunyuan_vae_kind(kind: str, title: str, channels: int, latent_dim: int) -> VAEKind:
    return VAEKind(title, channels, _hunyuan_vae(kind), latent_dim=latent_dim, sized=True,
                   narrowed_class="comfy.sd:" + HUNYUAN_VAES[kind][0], widths=_hunyuan_vae_widths(kind))


# Flux 2's VAE: the KL autoencoder with 32 latent channels whose 2 x 2 patches ComfyUI folds into 128 channels
# and batch-normalises (its ``bn`` statistics); ComfyUI fixes the width, so tiny files are narrower and say so
FLUX2_VAE_DDCONFIG = {**KL_DDCONFIG, "z_channels": 32, "batch_norm_latent": True}


def _flux2_vae_widths(size: str) -> dict:
    return {} if size == "full" else {"ddconfig": {**FLUX2_VAE_DDCONFIG, "ch": 32, "num_res_blocks": 1}}


def _flux2_vae(size: str) -> torch.nn.Module:
    from ..runtime import ensure_comfyui
    ensure_comfyui()
    from comfy.ldm.models.autoencoder import AutoencoderKL
    with torch.device("meta"):
        vae = AutoencoderKL(**{"ddconfig": FLUX2_VAE_DDCONFIG, **_flux2_vae_widths(size)}, embed_dim=32)
    vae.bn.num_batches_tracked = None   # an integer counter real files leave out; ComfyUI never reads it
    return vae


# CLIP-vision files ([model] clip_vision; Wan 2.1 i2v's clip_vision_h): ComfyUI's ViT-H/14 config, and the
# overrides of tiny files (real width 1280 and 257 tokens; their config travels in the file's metadata)
CLIP_VISION_H_CONFIG = "comfy/clip_vision_config_h.json"
CLIP_VISION_TINY = {"num_hidden_layers": 2, "intermediate_size": 256}


# Cosmos 1.0's causal continuous video tokenizer CV8x8x8 (16 channels, 8x spatial, 8x temporal): ComfyUI fixes
# its width and recognises a file by the decoder's Haar wavelets, a buffer the module does not save, so files
# carry it as an extra tensor. Its Patcher3D calls .item() while being built, so it is built on the CPU (the
# weights are never initialised: the shapes are all that is read) and moved to the meta device.
COSMOS1_VAE_DDCONFIG = {"z_channels": 16, "latent_channels": 16, "z_factor": 1, "resolution": 1024, "in_channels": 3,
                        "out_channels": 3, "channels": 128, "channels_mult": [2, 4, 4], "num_res_blocks": 2,
                        "attn_resolutions": [32], "dropout": 0.0, "patch_size": 4, "num_groups": 1,
                        "temporal_compression": 8, "spacial_compression": 8}


def _cosmos1_vae_widths(size: str) -> dict:
    return {} if size == "full" else {"channels": 16, "num_res_blocks": 1}


def _cosmos1_vae(size: str) -> torch.nn.Module:
    from ..runtime import ensure_comfyui
    ensure_comfyui()
    from comfy.ldm.cosmos.vae import CausalContinuousVideoTokenizer
    with torch.device("cpu"):
        vae = CausalContinuousVideoTokenizer(**{**COSMOS1_VAE_DDCONFIG, **_cosmos1_vae_widths(size)})
    return vae.to("meta")


def _haar_wavelets() -> torch.Tensor:
    return torch.full((2,), 0.5 ** 0.5)


VAES: dict[str, VAEKind] = {
    "kl16": VAEKind("16-channel KL VAE (Flux ae.safetensors, SD3 VAE)", 16, _kl_vae(16, quant_conv=False)),
    "kl4": VAEKind("SD/SDXL VAE", 4, _kl_vae(4, quant_conv=True)),
    "flux2": VAEKind("Flux 2 VAE", 128, _flux2_vae, sized=True, narrowed_class="comfy.sd:AutoencoderKL",
                     widths=_flux2_vae_widths, init={"bn.running_mean": "zeros", "bn.running_var": "ones"}),
    "wan21": VAEKind("Wan 2.1 VAE", 16, _wan21_vae, latent_dim=3, sized=True),
    "wan22": VAEKind("Wan 2.2 VAE", 48, _wan22_vae, latent_dim=3, sized=True,
                     narrowed_class="comfy.ldm.wan.vae2_2:WanVAE", widths=WAN22_VAE_DIMS.__getitem__),
    "ltxv": VAEKind("LTX-Video VAE", 128, _ltxv_vae, latent_dim=3, sized=True, file_metadata=_ltxv_vae_metadata,
                    init={"per_channel_statistics.std-of-means": "ones",
                          "per_channel_statistics.mean-of-means": "zeros"}),
    "hunyuan_video": _hunyuan_vae_kind("hunyuan_video", "HunyuanVideo causal 3D VAE", 16, 3),
    "hunyuan_video_15": _hunyuan_vae_kind("hunyuan_video_15", "HunyuanVideo 1.5 VAE", 32, 3),
    "hunyuan_image_21": _hunyuan_vae_kind("hunyuan_image_21", "HunyuanImage 2.1 VAE", 64, 2),
    "cosmos1_cv8x8x8": VAEKind("Cosmos 1.0 CV8x8x8 tokenizer", 16, _cosmos1_vae, latent_dim=3, sized=True,
                               narrowed_class="comfy.ldm.cosmos.vae:CausalContinuousVideoTokenizer",
                               widths=_cosmos1_vae_widths, init={"latent_std": "ones", "latent_mean": "zeros"},
                               extras={"encoder.patcher3d.wavelets": _haar_wavelets,
                                       "decoder.unpatcher3d.wavelets": _haar_wavelets}),
}
