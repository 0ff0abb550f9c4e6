"""The model files bench/diffusion_pipe.py gives diffusion-pipe: random weights with the real configs, written once
per folder (``written.json`` last, with diffusion-pipe's ``[model]`` section for them).

- Flux: a diffusers FluxPipeline folder (``diffusers_path``): the flux-dev transformer and VAE, one-layer CLIP-L / T5
  text encoders at the real output widths (diffusion-pipe caches their outputs before training).
- SDXL: a diffusers StableDiffusionXLPipeline folder (``checkpoint_path``): SDXL base 1.0's UNet, VAE and both text
  encoders at full depth (diffusion-pipe trains them with LoRA inside every step).
- Z-Image: ComfyUI-format files from ``pipetrain.backend.models.tiny`` with a full-depth Qwen3-4B text encoder
  (ComfyUI's ``load_clip`` does not read the shallow encoder's config and would leave missing layers empty).

Modules are built on the meta device and streamed to safetensors a tensor at a time. ``--size tiny``: small widths.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

FLUX_DEV = {"attention_head_dim": 128, "guidance_embeds": True, "in_channels": 64, "joint_attention_dim": 4096,
            "num_attention_heads": 24, "num_layers": 19, "num_single_layers": 38, "patch_size": 1,
            "pooled_projection_dim": 768, "axes_dims_rope": [16, 56, 56]}
FLUX_TINY = {**FLUX_DEV, "num_attention_heads": 2, "num_layers": 1, "num_single_layers": 1}
FLUX_VAE = {"act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
            "down_block_types": ["DownEncoderBlock2D"] * 4,
            "force_upcast": True, "in_channels": 3, "latent_channels": 16, "latents_mean": None, "latents_std": None,
            "layers_per_block": 2, "mid_block_add_attention": True, "norm_num_groups": 32, "out_channels": 3,
            "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
            "up_block_types": ["UpDecoderBlock2D"] * 4, "use_post_quant_conv": False, "use_quant_conv": False}
FLUX_VAE_TINY = {**FLUX_VAE, "block_out_channels": [32, 32, 32, 32], "layers_per_block": 1}
FLUX_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
                  "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
                  "use_dynamic_shifting": True}
CLIP_L = {"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
          "num_attention_heads": 12, "max_position_embeddings": 77, "projection_dim": 768, "hidden_act": "quick_gelu",
          "bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 1}
FLUX_CLIP_L = {**CLIP_L, "num_hidden_layers": 1}
# one layer, the real output width (4096) and vocabulary (the tokenizer's ids)
T5_XXL = {"vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 256, "num_layers": 1, "num_heads": 4,
          "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
          "relative_attention_max_distance": 128, "is_encoder_decoder": False, "use_cache": False,
          "tie_word_embeddings": False}

# SDXL base 1.0
SDXL_UNET = {"act_fn": "silu", "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
             "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280], "cross_attention_dim": 2048,
             "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
             "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
             "mid_block_type": "UNetMidBlock2DCrossAttn", "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
             "norm_num_groups": 32, "norm_eps": 1e-5, "projection_class_embeddings_input_dim": 2816,
             "sample_size": 128, "transformer_layers_per_block": [1, 2, 10], "use_linear_projection": True,
             "flip_sin_to_cos": True, "freq_shift": 0}
SDXL_VAE = {"act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
            "in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32,
            "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True}
OPENCLIP_BIGG = {**CLIP_L, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                 "num_attention_heads": 20, "hidden_act": "gelu", "projection_dim": 1280}
SDXL_SCHEDULER = {"_class_name": "EulerDiscreteScheduler", "beta_end": 0.012, "beta_schedule": "scaled_linear",
                  "beta_start": 0.00085, "clip_sample": False, "interpolation_type": "linear",
                  "num_train_timesteps": 1000, "prediction_type": "epsilon", "sample_max_value": 1.0,
                  "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
                  "timestep_spacing": "leading", "trained_betas": None, "use_karras_sigmas": False}
CLIP_TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "projection_dim": 32}
TINY_TIME_EMBED_DIM = 8


def sdxl_configs(size: str) -> dict[str, dict]:
    """Component folder -> config of the SDXL pipeline; tiny widths keep what the UNet reads consistent: the two
    encoders' states side by side (cross-attention) and six time ids plus the pooled projection (added embedding)."""
    if size == "full":
        return {"unet": SDXL_UNET, "vae": SDXL_VAE, "text_encoder": CLIP_L, "text_encoder_2": OPENCLIP_BIGG}
    te1, te2 = {**CLIP_L, **CLIP_TINY}, {**OPENCLIP_BIGG, **CLIP_TINY}
    unet = {**SDXL_UNET, "block_out_channels": [32, 64, 128], "attention_head_dim": [2, 4, 8],
            "transformer_layers_per_block": [1, 1, 2], "sample_size": 32,
            "cross_attention_dim": te1["hidden_size"] + te2["hidden_size"],
            "addition_time_embed_dim": TINY_TIME_EMBED_DIM,
            "projection_class_embeddings_input_dim": 6 * TINY_TIME_EMBED_DIM + te2["projection_dim"]}
    vae = {**SDXL_VAE, "block_out_channels": [32, 32, 32, 32], "layers_per_block": 1}
    return {"unet": unet, "vae": vae, "text_encoder": te1, "text_encoder_2": te2}


# --- one folder per arch ----------------------------------------------------------------------------
def model_folder(arch: str, root: Path, size: str) -> Path:
    return root / f"{arch}-dp-{size}"


def write_model_folder(arch: str, folder: Path, size: str, comfyui: Path, device: str = "cpu") -> dict:
    """Write ``arch``'s files into ``folder`` (skipped when complete); returns diffusion-pipe's [model] section."""
    marker = folder / "written.json"
    if not marker.exists():
        t = time.monotonic()
        section = WRITERS[arch](folder, size, comfyui, device)
        marker.write_text(json.dumps({"size": size, "write_s": round(time.monotonic() - t, 1), "model": section}))
    return json.loads(marker.read_text())["model"]


def write_flux_folder(folder: Path, size: str, comfyui: Path, device: str = "cpu") -> dict:
    import diffusers
    import torch
    import transformers

    full = size == "full"
    _write_model_index(folder, "FluxPipeline", {
        "feature_extractor": [None, None], "image_encoder": [None, None],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]})
    _write_json(folder / "scheduler" / "scheduler_config.json", {**FLUX_SCHEDULER, **_diffusers_version()})
    _write_diffusers_component(folder / "transformer", diffusers.FluxTransformer2DModel,
                               FLUX_DEV if full else FLUX_TINY, device)
    _write_diffusers_component(folder / "vae", diffusers.AutoencoderKL, FLUX_VAE if full else FLUX_VAE_TINY, device)
    # one layer each: small enough to build in memory (T5's tied embeddings are no case for the streaming writer)
    for sub, model in (("text_encoder", transformers.CLIPTextModel(transformers.CLIPTextConfig(**FLUX_CLIP_L))),
                       ("text_encoder_2", transformers.T5EncoderModel(transformers.T5Config(**T5_XXL)))):
        model.to(torch.bfloat16).save_pretrained(folder / sub)
    write_clip_tokenizer(folder / "tokenizer", comfyui)
    write_t5_tokenizer(folder / "tokenizer_2", comfyui)
    return {"type": "flux", "diffusers_path": str(folder), "dtype": "bfloat16", "transformer_dtype": "bfloat16",
            "flux_shift": True}


def write_sdxl_folder(folder: Path, size: str, comfyui: Path, device: str = "cpu") -> dict:
    import diffusers
    import transformers

    configs = sdxl_configs(size)
    _write_model_index(folder, "StableDiffusionXLPipeline", {
        "force_zeros_for_empty_prompt": True, "scheduler": ["diffusers", "EulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"]})
    _write_json(folder / "scheduler" / "scheduler_config.json", {**SDXL_SCHEDULER, **_diffusers_version()})
    _write_diffusers_component(folder / "unet", diffusers.UNet2DConditionModel, configs["unet"], device)
    _write_diffusers_component(folder / "vae", diffusers.AutoencoderKL, configs["vae"], device)
    for sub, cls in (("text_encoder", transformers.CLIPTextModel),
                     ("text_encoder_2", transformers.CLIPTextModelWithProjection)):
        _write_transformers_component(folder / sub, cls, transformers.CLIPTextConfig(**configs[sub]), device)
    for sub in ("tokenizer", "tokenizer_2"):
        write_clip_tokenizer(folder / sub, comfyui)
    return {"type": "sdxl", "checkpoint_path": str(folder), "dtype": "bfloat16"}


def write_zimage_files(folder: Path, size: str, comfyui: Path, device: str = "cpu") -> dict:
    import torch

    from pipetrain.backend.models.tiny import write_model_files

    files = write_model_files("z_image", folder, size, torch.bfloat16, text_encoder_size=size, init_device=device)
    return {"type": "z_image", "diffusion_model": str(files.diffusion_model), "vae": str(files.vae),
            "text_encoders": [{"path": str(path), "type": "lumina2"} for path in files.text_encoders],
            "dtype": "bfloat16"}


WRITERS = {"flux": write_flux_folder, "sdxl": write_sdxl_folder, "z_image": write_zimage_files}


# --- pieces of a diffusers folder ---------------------------------------------------------------------
def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def _diffusers_version() -> dict:
    import diffusers
    return {"_diffusers_version": diffusers.__version__}


def _write_model_index(folder: Path, pipeline: str, components: dict) -> None:
    _write_json(folder / "model_index.json", {"_class_name": pipeline, **_diffusers_version(), **components})


def _write_diffusers_component(folder: Path, cls: type, config: dict, device: str) -> None:
    import torch

    from pipetrain.backend.models.tiny import write_safetensors

    with torch.device("meta"):
        module = cls(**config)
    _write_json(folder / "config.json", {"_class_name": cls.__name__, **_diffusers_version(), **config})
    write_safetensors(module, folder / "diffusion_pytorch_model.safetensors", torch.bfloat16, 0, {"format": "pt"},
                      device=device)


def _write_transformers_component(folder: Path, cls: type, config, device: str) -> None:
    import torch

    from pipetrain.backend.models.tiny import write_safetensors

    with torch.device("meta"):
        module = cls(config)
    config.save_pretrained(folder)
    write_safetensors(module, folder / "model.safetensors", torch.bfloat16, 0, {"format": "pt"}, device=device)


def write_clip_tokenizer(folder: Path, comfyui: Path) -> None:
    """CLIP-L's tokenizer from the files ComfyUI ships (nothing can be downloaded)."""
    source = comfyui / "comfy" / "sd1_tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("vocab.json", "merges.txt", "special_tokens_map.json"):
        shutil.copy(source / name, folder / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    # ComfyUI's copy says 8192; the pipelines pad or chunk CLIP text to model_max_length, which must fit 77 positions
    config.update(model_max_length=77)
    config.pop("special_tokens_map_file", None)
    _write_json(folder / "tokenizer_config.json", config)


def write_t5_tokenizer(folder: Path, comfyui: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(comfyui / "comfy" / "text_encoders" / "t5_tokenizer" / name, folder / name)
