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


def _comfy_text_model(path: str):
    """``build`` for a ComfyUI text-model class taking (config, dtype, device, operations), e.g.
    ``comfy.text_encoders.t5:T5``."""
    def build(config: dict) -> torch.nn.Module:
        import importlib

        from ..runtime import ensure_comfyui
        ensure_comfyui()
        import comfy.ops
        module, _, name = path.partition(":")
        cls = getattr(importlib.import_module(module), name)
        return cls(config, torch.float32, "meta", comfy.ops.disable_weight_init)
    return build


CLIP_TEXT_MODEL = _comfy_text_model("comfy.clip_model:CLIPTextModel")
T5_MODEL = _comfy_text_model("comfy.text_encoders.t5:T5")


def _umt5_spiece() -> torch.Tensor:
    """A SentencePiece model as the uint8 ``spiece_model`` tensor real UMT5 files carry (ComfyUI's Wan
    tokenizer reads it from the file). UMT5's own is not shipped with ComfyUI, so tiny files get a 2000-piece
    model with UMT5's special ids (pad 0, end 1, unknown 2), trained deterministically on the words of the
    T5-pile tokenizer that ComfyUI does ship."""
    import io

    import sentencepiece

    from ..runtime import ensure_comfyui
    pile = sentencepiece.SentencePieceProcessor(
        model_file=str(ensure_comfyui() / "comfy/text_encoders/t5_pile_tokenizer/tokenizer.model"))
    words = [w for w in (pile.id_to_piece(i).replace("\u2581", "") for i in range(pile.get_piece_size()))
             if w.isascii() and w.isalpha()]
    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(words), model_writer=out, vocab_size=UMT5_TINY_VOCAB, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, num_threads=1, minloglevel=2)
    return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)


UMT5_TINY_VOCAB = 2000


# Output widths stay real: CLIP-L 768, CLIP-G 1280, T5 / UMT5 4096 (the diffusion models' context widths).
TEXT_ENCODERS: dict[str, TextEncoderKind] = {
    "clip_l": TextEncoderKind("CLIP-L", "comfy/sd1_clip_config.json",
                              {"num_hidden_layers": 3, "intermediate_size": 256}, CLIP_TEXT_MODEL, "CLIP_L"),
    "clip_g": TextEncoderKind("CLIP-G", "comfy/clip_config_bigg.json",
                              {"num_hidden_layers": 3, "intermediate_size": 256}, CLIP_TEXT_MODEL, "CLIP_G"),
    "t5xxl": TextEncoderKind("T5-XXL", "comfy/text_encoders/t5_config_xxl.json",
                             {"num_layers": 2, "num_heads": 4, "d_ff": 256}, T5_MODEL, "T5_XXL"),
    "umt5xxl": TextEncoderKind("UMT5-XXL", "comfy/text_encoders/umt5_config_xxl.json",
                               {"num_layers": 2, "num_heads": 4, "d_ff": 256, "vocab_size": UMT5_TINY_VOCAB}, T5_MODEL,
                               "T5_XXL", extras={"spiece_model": _umt5_spiece}),
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


VAES: dict[str, VAEKind] = {
    "kl16": VAEKind("16-channel KL VAE (Flux ae.safetensors, SD3 VAE)", 16, _kl_vae(16, quant_conv=False)),
    "kl4": VAEKind("SD/SDXL VAE", 4, _kl_vae(4, quant_conv=True)),
    "wan21": VAEKind("Wan 2.1 VAE", 16, _wan21_vae, latent_dim=3, sized=True),
}
