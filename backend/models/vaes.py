# SPDX-License-Identifier: GPL-3.0-or-later
"""VAE file kinds, shared between architectures (an ``ArchSpec`` names its kind): each kind's latent channels, the
module ComfyUI builds for one of its files and, where ComfyUI fixes the width, the widths tiny files name."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .spec import comfy_object


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
    # init rule ("ones" / "zeros" / "fan_in") for tiny files where the generic one would be wrong (e.g. a latent
    # std); a key ending in "." sets the random weights of that submodule
    file_metadata: Callable[[str], dict[str, str]] | None = None
    init: dict[str, str] = field(default_factory=dict)
    # tensors a file of this kind carries besides the module's state dict (name -> () -> tensor), e.g. a buffer
    # ComfyUI's detection looks for but the module does not save (the Cosmos tokenizer's wavelets)
    extras: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    # the channels its decoder's first convolution takes, where they are not latent_channels (Flux 2's latents are
    # 2x2 patches of 32 channels): check-config tells a VAE of another kind by them (``decoder_channels``)
    decoder_in: int | None = None

    @property
    def decoder_channels(self) -> int:
        return self.decoder_in or self.latent_channels


# the decoder's first convolution in each layout (ComfyUI's KL, Hunyuan / LTX causal, Wan; diffusers' VAE folders)
DECODER_INPUTS = ("decoder.conv_in.weight", "decoder.conv_in.conv.weight", "decoder.conv1.weight")


def decoder_channels(shapes: dict[str, tuple]) -> int | None:
    """The channels a VAE file's decoder takes, from its header; None where its layout does not tell."""
    shape = next((shapes[k] for k in DECODER_INPUTS if k in shapes), None)
    return shape[1] if shape is not None and len(shape) >= 4 else None


# The KL autoencoder ComfyUI builds for SD-family, SD3 and Flux VAEs.
KL_DDCONFIG = {
    "double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
    "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
}


def _kl_vae(z_channels: int, quant_conv: bool):
    def build(size: str) -> torch.nn.Module:
        AutoencoderKL = comfy_object("comfy.ldm.models.autoencoder:AutoencoderKL")
        AutoencodingEngine = comfy_object("comfy.ldm.models.autoencoder:AutoencodingEngine")
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
    WanVAE = comfy_object("comfy.ldm.wan.vae:WanVAE")
    with torch.device("meta"):
        return WanVAE(dim=WAN21_VAE_DIM[size], z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                      temperal_downsample=[False, True, True], dropout=0.0)


# Wan 2.2 VAE (48 channels, 16x spatial): ComfyUI builds it at (dim 160, dec_dim 256) whatever the file holds
WAN22_VAE_DIMS = {"micro": {"dim": 16, "dec_dim": 16}, "tiny": {"dim": 16, "dec_dim": 16}, "full": {}}


def _wan22_vae(size: str) -> torch.nn.Module:
    WanVAE = comfy_object("comfy.ldm.wan.vae2_2:WanVAE")
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
    VideoVAE = comfy_object("comfy.ldm.lightricks.vae.causal_video_autoencoder:VideoVAE")
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
        autoencoder = comfy_object("comfy.ldm.models.autoencoder")
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
    AutoencoderKL = comfy_object("comfy.ldm.models.autoencoder:AutoencoderKL")
    with torch.device("meta"):
        vae = AutoencoderKL(**{"ddconfig": FLUX2_VAE_DDCONFIG, **_flux2_vae_widths(size)}, embed_dim=32)
    vae.bn.num_batches_tracked = None   # an integer counter real files leave out; ComfyUI never reads it
    return vae


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
    CausalContinuousVideoTokenizer = comfy_object("comfy.ldm.cosmos.vae:CausalContinuousVideoTokenizer")
    with torch.device("cpu"):
        vae = CausalContinuousVideoTokenizer(**{**COSMOS1_VAE_DDCONFIG, **_cosmos1_vae_widths(size)})
    return vae.to("meta")


def _haar_wavelets() -> torch.Tensor:
    return torch.full((2,), 0.5 ** 0.5)


# ACE-Step's music DCAE (mel spectrogram -> 8 x 16 x L latents) with its HiFi-GAN vocoder: ComfyUI builds both at
# their published widths (``MusicDCAE(source_sample_rate=44100)``); tiny files are narrower and say so. The mel
# layout (128 bins, hop 512) and the DCAE's 8x downsampling stay, so latents keep the real shape.
ACE_VAE_TINY = {
    "dcae_config": {"attention_head_dim": 8, "encoder_block_out_channels": [8, 8, 16, 16],
                    "decoder_block_out_channels": [8, 8, 16, 16], "encoder_layers_per_block": [1, 1, 1, 1],
                    "decoder_layers_per_block": [1, 1, 1, 1]},
    # num_mels is the width the HiFi-GAN head reads from the backbone (its last dim), not the mel bins
    "vocoder_config": {"depths": [1, 1, 1, 1], "dims": [8, 8, 8, 8], "upsample_initial_channel": 128,
                       "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]], "num_mels": 8},
}


# MusicDCAE names itself in ``super(MusicDCAE, self)``, so the classes it builds are narrowed instead (a
# ``narrowed_class`` of several targets takes widths keyed by target)
ACE_VAE_PARTS = {"dcae_config": "comfy.ldm.ace.vae.music_dcae_pipeline:AutoencoderDC",
                 "vocoder_config": "comfy.ldm.ace.vae.music_dcae_pipeline:ADaMoSHiFiGANV1"}


def _ace_vae_widths(size: str) -> dict:
    return {} if size == "full" else {ACE_VAE_PARTS[k]: v for k, v in ACE_VAE_TINY.items()}


def _ace_vae(size: str) -> torch.nn.Module:
    # its vocoder reads drop-path rates with .item() while being built: built on the CPU, then moved to meta
    MusicDCAE = comfy_object("comfy.ldm.ace.vae.music_dcae_pipeline:MusicDCAE")
    with torch.device("cpu"):
        vae = MusicDCAE(source_sample_rate=44100, **({} if size == "full" else ACE_VAE_TINY))
    return vae.to("meta")


VAES: dict[str, VAEKind] = {
    "kl16": VAEKind("16-channel KL VAE (Flux ae.safetensors, SD3 VAE)", 16, _kl_vae(16, quant_conv=False)),
    "kl4": VAEKind("SD/SDXL VAE", 4, _kl_vae(4, quant_conv=True)),
    "flux2": VAEKind("Flux 2 VAE", 128, _flux2_vae, sized=True, narrowed_class="comfy.sd:AutoencoderKL",
                     decoder_in=32, widths=_flux2_vae_widths,
                     init={"bn.running_mean": "zeros", "bn.running_var": "ones"}),
    "wan21": VAEKind("Wan 2.1 VAE", 16, _wan21_vae, latent_dim=3, sized=True),
    "wan22": VAEKind("Wan 2.2 VAE", 48, _wan22_vae, latent_dim=3, sized=True,
                     narrowed_class="comfy.ldm.wan.vae2_2:WanVAE", widths=WAN22_VAE_DIMS.__getitem__),
    "ltxv": VAEKind("LTX-Video VAE", 128, _ltxv_vae, latent_dim=3, sized=True, file_metadata=_ltxv_vae_metadata,
                    init={"per_channel_statistics.std-of-means": "ones",
                          "per_channel_statistics.mean-of-means": "zeros"}),
    "hunyuan_video": _hunyuan_vae_kind("hunyuan_video", "HunyuanVideo causal 3D VAE", 16, 3),
    "hunyuan_video_15": _hunyuan_vae_kind("hunyuan_video_15", "HunyuanVideo 1.5 VAE", 32, 3),
    "hunyuan_image_21": _hunyuan_vae_kind("hunyuan_image_21", "HunyuanImage 2.1 VAE", 64, 2),
    "ace_dcae": VAEKind("ACE-Step music DCAE + vocoder", 8, _ace_vae, sized=True,
                        narrowed_class=",".join(ACE_VAE_PARTS.values()), widths=_ace_vae_widths,
                        # HiFi-GAN's 7 upsampling stages at std 0.02 leave ~1e-19 of a waveform: silence
                        init={"vocoder.head.": "fan_in"}),
    "cosmos1_cv8x8x8": VAEKind("Cosmos 1.0 CV8x8x8 tokenizer", 16, _cosmos1_vae, latent_dim=3, sized=True,
                               narrowed_class="comfy.ldm.cosmos.vae:CausalContinuousVideoTokenizer",
                               widths=_cosmos1_vae_widths, init={"latent_std": "ones", "latent_mean": "zeros"},
                               extras={"encoder.patcher3d.wavelets": _haar_wavelets,
                                       "decoder.unpatcher3d.wavelets": _haar_wavelets}),
}


def kinds() -> dict[str, VAEKind]:
    """Every VAE kind by name: the shared ones above and those a model declares in its own spec."""
    from .registry import declared_kinds
    return {**VAES, **declared_kinds("vae_kinds")}


def kind(name: str) -> VAEKind:
    """The VAE kind ``name`` (``kinds``)."""
    return VAES[name] if name in VAES else kinds()[name]
