"""The model files bench/diffusion_pipe.py gives diffusion-pipe: random weights with the real configs, written once
per folder (``written.json`` last, with diffusion-pipe's ``[model]`` section for them).

- Flux: a diffusers FluxPipeline folder (``diffusers_path``): the flux-dev transformer and VAE, one-layer CLIP-L / T5
  text encoders at the real output widths (diffusion-pipe caches their outputs before training).
- SDXL: a diffusers StableDiffusionXLPipeline folder (``checkpoint_path``): SDXL base 1.0's UNet, VAE and both text
  encoders at full depth (diffusion-pipe trains them with LoRA inside every step).
- Z-Image: ComfyUI-format files from ``pipetrain.backend.models.tiny`` with a full-depth Qwen3-4B text encoder
  (ComfyUI's ``load_clip`` does not read the shallow encoder's config and would leave missing layers empty).
- Qwen-Image: a diffusers folder (``diffusers_path``) with ``transformer/``, ``vae/`` and ``text_encoder/``
  safetensors. diffusion-pipe builds all three from its own full configs (``configs/qwen_image`` in its checkout,
  also its tokenizer and processor) on the meta device and sets each tensor the file holds, so every parameter
  must be there: the 20B transformer, the Qwen-Image VAE and the whole Qwen2.5-VL-7B text encoder, vision tower
  included (a meta tensor left over breaks its ``.to('cuda')``). The text encoder file holds a Qwen2.5-VL
  checkpoint's keys (``model.*``, ``visual.*``, ``lm_head.weight``), which its loader renames. Full size:
  40.9 GB transformer + 16.6 GB text encoder + 0.25 GB VAE = 57.7 GB (53.7 GiB) of the GPU machine's 64 GiB disk:
  nothing else that large fits beside it (run.py's own Qwen-Image files, 41 GB, must be gone first).
- Wan 2.1: the official checkpoint folder diffusion-pipe's ``ckpt_path`` names (``config.json``,
  ``Wan2.1_VAE.pth``, tokenizer ``google/umt5-xxl``), with the transformer and the full-depth UMT5-XXL encoder
  as ComfyUI-format files from ``pipetrain.backend.models.tiny`` (``transformer_path``, ``llm_path``: diffusion-pipe
  maps ComfyUI's UMT5 keys itself and strictly loads all 24 blocks, so a shallow encoder would not do). The VAE is
  ComfyUI's file resaved as the ``.pth`` diffusion-pipe ``torch.load``s (same keys). The 1.3B variant: 2.8 GB
  transformer + 11.4 GB encoder + 0.25 GB VAE = 14.5 GB. The tokenizer is a stand-in: the real umt5-xxl one
  cannot be downloaded and ComfyUI ships none as files. Text is encoded once and cached before training, and
  Wan pads it to 512 tokens whatever it says, so the timed step does not depend on which ids the tokenizer gives;
  the stand-in only has to load with ``AutoTokenizer`` and give valid UMT5 ids (a word-level vocabulary of the
  bench caption's words after T5's pad 0, end 1 and unknown 2).

- HunyuanVideo (t2v 13B): the ComfyUI files diffusion-pipe's README names (``transformer_path``, ``vae_path``,
  ``llm_path``, ``clip_path``). The transformer is ComfyUI's model saved as ComfyUI saves it (``model.model.*``, the
  layout diffusion-pipe maps to the original names; ComfyUI's loader strips the prefix). ``llm_path`` is a Hugging
  Face folder of the LLaVA-Llama-3-8B text model (full depth: ``config.json`` of Llama-3-8B with ComfyUI's 128320
  ids, ``model.safetensors`` in ComfyUI's and transformers' shared ``model.*`` names, ComfyUI's Llama-3 tokenizer),
  ``clip_path`` one of CLIP-L (``text_model.*``, ComfyUI's CLIP-L tokenizer). The VAE is two files: diffusion-pipe
  loads its own class strictly from the original names (diffusers' AutoencoderKLHunyuanVideo has the same names and,
  by default, its config), PipeTrain reads ComfyUI's file. Full size: 25.6 GB transformer + 15.0 GB Llama + 0.25 GB
  CLIP-L + 2 x 0.5 GB VAE = 41.9 GB. The Wan 2.1 14B folder: 28.6 GB transformer + 11.4 GB encoder + 2 x 0.25 GB VAE
  = 40.5 GB; the two cannot be on the GPU machine's 64 GiB disk together (run.py's ``free_disk_for``).

Where formats allow, PipeTrain trains on the same files (``pipetrain_files``: Wan's transformer, ComfyUI VAE and
UMT5; HunyuanVideo's transformer, ComfyUI VAE, Llama and CLIP-L files), so one case's files are written once.

Modules are built on the meta device and streamed to safetensors a tensor at a time. ``--size tiny``: small widths
(diffusion-pipe itself reads only its full configs; the tiny files check the writers on the CPU).
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
# what ComfyUI loads from a folder: it fixes Flux's 24 heads of 128 (Flux-dev's width, one block of each kind)
FLUX_COMFY_TINY = {**FLUX_DEV, "num_layers": 1, "num_single_layers": 1}
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

# Qwen-Image (Qwen/Qwen-Image): the fields of diffusion-pipe's configs/qwen_image that shape the weights
QWEN_IMAGE_TRANSFORMER = {"attention_head_dim": 128, "axes_dims_rope": [16, 56, 56], "guidance_embeds": False,
                          "in_channels": 64, "joint_attention_dim": 3584, "num_attention_heads": 24, "num_layers": 60,
                          "out_channels": 16, "patch_size": 2}
# the Wan 2.1 VAE's latent statistics, which Qwen-Image's VAE shares
WAN21_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN21_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916]
QWEN_IMAGE_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
                  "temperal_downsample": [False, True, True], "dropout": 0.0, "latents_mean": WAN21_LATENTS_MEAN,
                  "latents_std": WAN21_LATENTS_STD}
# Qwen2.5-VL-7B-Instruct, vision tower included
QWEN25_VL_7B = {"tie_word_embeddings": False,
                "text_config": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                                "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                                "rms_norm_eps": 1e-6},
                "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                                  "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31],
                                  "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                                  "window_size": 112}}
QWEN_IMAGE = {"transformer": QWEN_IMAGE_TRANSFORMER, "vae": QWEN_IMAGE_VAE, "text_encoder": QWEN25_VL_7B}
QWEN_IMAGE_TINY = {
    "transformer": {**QWEN_IMAGE_TRANSFORMER, "num_attention_heads": 2, "num_layers": 1, "joint_attention_dim": 64},
    "vae": {**QWEN_IMAGE_VAE, "base_dim": 16, "num_res_blocks": 1},
    "text_encoder": {"tie_word_embeddings": False,
                     "text_config": {"vocab_size": 1024, "bos_token_id": 0, "eos_token_id": 1, "hidden_size": 64,
                                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                                     "num_key_value_heads": 1},
                     "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                                       "out_hidden_size": 64, "fullatt_block_indexes": [1]}}}

# Wan 2.1: what diffusion-pipe finds in the official checkpoint folder
WAN_TOKENIZER = "google/umt5-xxl"
WAN_VAE_FILE = "Wan2.1_VAE.pth"
WAN_TEXT_LEN = 512
# the official config.json's fields (WanModel's arguments; ComfyUI's others are the defaults)
WAN_CHECKPOINT_FIELDS = ("model_type", "dim", "ffn_dim", "freq_dim", "in_dim", "num_heads", "num_layers", "out_dim",
                         "eps")
UMT5_SPECIAL_IDS = {"<pad>": 0, "</s>": 1, "<unk>": 2}

# HunyuanVideo: ComfyUI's saved layout of the model (its process_unet_state_dict_for_saving), which diffusion-pipe maps
HUNYUAN_TRANSFORMER_PREFIX = "model.model."
# diffusion-pipe's llm_path / clip_path folders -> PipeTrain's text-encoder kinds (their keys are transformers')
HUNYUAN_TEXT_FOLDERS = {"llm": "llama", "clip": "clip_l"}
LLAMA_HEAD_DIM = 128                  # ComfyUI's Llama2Config.head_dim (a class attribute, not a field)
LLAMA3_SPECIAL_IDS = {"bos_token_id": 128000, "eos_token_id": 128001}
# the tiny VAE for diffusion-pipe's class (its own config file holds the full one, diffusers' defaults)
HUNYUAN_VAE_TINY = {"block_out_channels": [32, 32, 32, 32], "layers_per_block": 1}
PIPETRAIN_FILES = "pipetrain_files"   # a writer's entry: the files PipeTrain trains the case on (written.json)


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
def model_folder(arch: str, root: Path, size: str, variant: str | None = None) -> Path:
    return root / (f"{arch}-dp-{size}" + (f"-{variant}" if variant and size == "full" else ""))


def write_model_folder(arch: str, folder: Path, size: str, comfyui: Path, device: str = "cpu",
                       variant: str | None = None) -> dict:
    """Write ``arch``'s files into ``folder`` (skipped when complete); returns diffusion-pipe's [model] section.
    ``variant``: a published size other than the arch's full one (run.py's VARIANTS), for the writers that take it."""
    marker = folder / "written.json"
    if not marker.exists():
        t = time.monotonic()
        options = {"variant": variant} if variant else {}
        section = WRITERS[arch](folder, size, comfyui, device, **options)
        shared = section.pop(PIPETRAIN_FILES, None)
        marker.write_text(json.dumps({"size": size, "write_s": round(time.monotonic() - t, 1), "model": section,
                                      **({PIPETRAIN_FILES: shared} if shared else {})}))
    return json.loads(marker.read_text())["model"]


def pipetrain_files(folder: Path) -> dict | None:
    """The written folder's files PipeTrain trains on (run.py's ``write_models`` result), where its writer shares
    them; None for folders in formats PipeTrain does not read here."""
    return json.loads((folder / "written.json").read_text()).get(PIPETRAIN_FILES)


def write_flux_folder(folder: Path, size: str, comfyui: Path, device: str = "cpu", comfy_widths: bool = False) -> dict:
    """``comfy_widths``: a tiny folder ComfyUI loads too (PipeTrain's ``diffusers_path`` tests): the transformer at
    Flux-dev's width and the VAE at full width, which ComfyUI's Flux detection and VAE loader take as fixed."""
    import diffusers
    import torch
    import transformers

    full = size == "full"
    transformer = FLUX_DEV if full else FLUX_COMFY_TINY if comfy_widths else FLUX_TINY
    vae = FLUX_VAE if full or comfy_widths else FLUX_VAE_TINY
    _write_model_index(folder, "FluxPipeline", {
        "feature_extractor": [None, None], "image_encoder": [None, None],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]})
    _write_json(folder / "scheduler" / "scheduler_config.json", {**FLUX_SCHEDULER, **_diffusers_version()})
    _write_diffusers_component(folder / "transformer", diffusers.FluxTransformer2DModel, transformer, device)
    _write_diffusers_component(folder / "vae", diffusers.AutoencoderKL, vae, device)
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


def qwen_image_configs(size: str) -> dict[str, dict]:
    return QWEN_IMAGE if size == "full" else QWEN_IMAGE_TINY


def qwen_image_modules(size: str) -> dict:
    """Component folder -> the module whose state dict its file holds, on the meta device."""
    import diffusers
    import torch
    import transformers

    configs = qwen_image_configs(size)
    with torch.device("meta"):
        text_encoder = transformers.Qwen2_5_VLForConditionalGeneration(
            transformers.Qwen2_5_VLConfig(**configs["text_encoder"]))
        return {"transformer": diffusers.QwenImageTransformer2DModel(**configs["transformer"]),
                "vae": diffusers.AutoencoderKLQwenImage(**configs["vae"]),
                "text_encoder": qwen25_vl_checkpoint_layout(text_encoder)}


def qwen25_vl_checkpoint_layout(model) -> object:
    """``model``'s modules under a Qwen2.5-VL checkpoint's names: ``model.*`` (the language model), ``visual.*`` and
    ``lm_head.weight``, the keys diffusion-pipe's loader renames into the transformers class."""
    import torch

    layout = torch.nn.Module()
    layout.model, layout.visual, layout.lm_head = model.model.language_model, model.model.visual, model.lm_head
    return layout


def write_qwen_image_folder(folder: Path, size: str, comfyui: Path, device: str = "cpu") -> dict:
    import transformers

    configs, modules = qwen_image_configs(size), qwen_image_modules(size)
    for sub in ("transformer", "vae"):
        _write_diffusers_weights(folder / sub, modules[sub], configs[sub], device)
    transformers.Qwen2_5_VLConfig(**configs["text_encoder"]).save_pretrained(folder / "text_encoder")
    _write_weights(modules["text_encoder"], folder / "text_encoder" / "model.safetensors", device)
    return {"type": "qwen_image", "diffusers_path": str(folder), "dtype": "bfloat16", "transformer_dtype": "bfloat16"}


def wan_unet_config(size: str, variant: str | None = None) -> dict:
    from pipetrain.backend.models.registry import arch_spec
    from pipetrain.bench.run import VARIANTS

    return VARIANTS[variant]() if variant and size == "full" else arch_spec("wan").unet_config(size)


def wan_checkpoint_config(unet_config: dict) -> dict:
    """The official checkpoint's config.json for ComfyUI's ``unet_config`` of a Wan model."""
    return {"_class_name": "WanModel", **{key: unet_config[key] for key in WAN_CHECKPOINT_FIELDS},
            "text_len": WAN_TEXT_LEN}


def write_wan_folder(folder: Path, size: str, comfyui: Path, device: str = "cpu", variant: str | None = None) -> dict:
    import torch
    from safetensors.torch import load_file

    from pipetrain.backend.models.tiny import write_model_files
    from pipetrain.bench.run import bench_caption

    unet_config = wan_unet_config(size, variant)
    files = write_model_files("wan", folder, size, torch.bfloat16, text_encoder_size=size, init_device=device,
                              unet_config=unet_config)
    # diffusion-pipe torch.loads the official VAE .pth; ComfyUI's VAE file holds the same keys (kept for PipeTrain)
    torch.save(load_file(files.vae), folder / WAN_VAE_FILE)
    _write_json(folder / "config.json", wan_checkpoint_config(unet_config))
    write_umt5_stand_in_tokenizer(folder / WAN_TOKENIZER, bench_caption("wan"))
    (text_encoder,) = files.text_encoders
    return {"type": "wan", "ckpt_path": str(folder), "transformer_path": str(files.diffusion_model),
            "llm_path": str(text_encoder), "dtype": "bfloat16",
            PIPETRAIN_FILES: {"diffusion_model": str(files.diffusion_model), "vae": str(files.vae),
                              "text_encoders": [str(text_encoder)]}}


def comfyui_saved_layout(module):
    """``module`` under ComfyUI's saved names of a HunyuanVideo model (``model.model.*``)."""
    import torch

    layout, inner = torch.nn.Module(), torch.nn.Module()
    inner.model = module
    layout.model = inner
    return layout


def hunyuan_video_modules(size: str) -> dict:
    """File -> (module on the meta device, init rules) of the files both trainers read: the transformer in
    ComfyUI's saved layout, the Llama-3-8B and CLIP-L text models (ComfyUI's classes; their keys are transformers')."""
    import torch

    from pipetrain.backend.models.registry import arch_spec
    from pipetrain.backend.models.tiny import build_text_encoder, text_encoder_config

    spec = arch_spec("hunyuan_video")
    config = spec.unet_config(size)
    with spec.built_in(config), torch.device("meta"):
        transformer = comfyui_saved_layout(spec.build(config))
    init = {HUNYUAN_TRANSFORMER_PREFIX + key: rule for key, rule in (spec.diffusion_model_init or {}).items()}
    modules = {"transformer": (transformer, init)}
    for sub, kind in HUNYUAN_TEXT_FOLDERS.items():
        modules[sub] = (build_text_encoder(kind, text_encoder_config(kind, size)), None)
    return modules


def hunyuan_llama_config(size: str):
    """transformers' LlamaConfig of ComfyUI's LLaVA-Llama-3-8B text model (or the tiny one)."""
    import transformers

    from pipetrain.backend.models.tiny import text_encoder_config

    c = text_encoder_config("llama", size)
    return transformers.LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], head_dim=LLAMA_HEAD_DIM,
        max_position_embeddings=c["max_position_embeddings"], rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c["rope_theta"], tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
        **LLAMA3_SPECIAL_IDS)


def write_llama_tokenizer(folder: Path, comfyui: Path) -> None:
    """ComfyUI's Llama-3 tokenizer (LLaVA-Llama-3's ids, '<pad>' included) as a fast tokenizer AutoTokenizer
    loads: its tokenizer.json is the whole tokenizer, the class it names in its config is a slow one."""
    source = comfyui / "comfy" / "text_encoders" / "llama_tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast")
    _write_json(folder / "tokenizer_config.json", config)


def hunyuan_dp_vae(size: str):
    """The VAE diffusion-pipe loads (its HunyuanVideo class, its names) as diffusers' port of it, whose defaults are
    diffusion-pipe's config; on the meta device."""
    import diffusers
    import torch

    with torch.device("meta"):
        return diffusers.AutoencoderKLHunyuanVideo(**({} if size == "full" else HUNYUAN_VAE_TINY))


def write_hunyuan_video_files(folder: Path, size: str, comfyui: Path, device: str = "cpu") -> dict:
    import torch
    import transformers

    from pipetrain.backend.models.loading import META_ARCH, META_TE, META_TE_KIND
    from pipetrain.backend.models.tiny import SHALLOW, _vae_metadata, text_encoder_config, write_safetensors
    from pipetrain.backend.models.vaes import VAES

    folder.mkdir(parents=True, exist_ok=True)
    modules = hunyuan_video_modules(size)
    transformer, init = modules["transformer"]
    # transformers reads a safetensors file whose metadata says "format": "pt"
    write_safetensors(transformer, folder / "transformer.safetensors", torch.bfloat16, 0,
                      {"format": "pt", META_ARCH: "hunyuan_video", "pipetrain.size": size}, device=device, init=init)
    for seed, (sub, kind) in enumerate(HUNYUAN_TEXT_FOLDERS.items(), start=2):
        meta = {"format": "pt", META_TE_KIND: kind, "pipetrain.size": size}
        if size in ("tiny", SHALLOW):
            meta[META_TE] = json.dumps(text_encoder_config(kind, size))
        write_safetensors(modules[sub][0], folder / sub / "model.safetensors", torch.bfloat16, seed, meta,
                          device=device)
    hunyuan_llama_config(size).save_pretrained(folder / "llm")
    write_llama_tokenizer(folder / "llm", comfyui)
    transformers.CLIPTextConfig(**text_encoder_config("clip_l", size)).save_pretrained(folder / "clip")
    write_clip_tokenizer(folder / "clip", comfyui)
    vae = VAES["hunyuan_video"]
    write_safetensors(vae.build(size), folder / "comfyui_vae.safetensors", torch.bfloat16, 1,
                      _vae_metadata("hunyuan_video", size), {name: make() for name, make in vae.extras.items()},
                      device=device, init=vae.init)
    _write_weights(hunyuan_dp_vae(size), folder / "vae.safetensors", device)
    return {"type": "hunyuan-video", "transformer_path": str(folder / "transformer.safetensors"),
            "vae_path": str(folder / "vae.safetensors"), "llm_path": str(folder / "llm"),
            "clip_path": str(folder / "clip"), "dtype": "bfloat16",
            PIPETRAIN_FILES: {"diffusion_model": str(folder / "transformer.safetensors"),
                              "vae": str(folder / "comfyui_vae.safetensors"),
                              "text_encoders": [str(folder / sub / "model.safetensors")
                                                for sub in HUNYUAN_TEXT_FOLDERS]}}


WRITERS = {"flux": write_flux_folder, "sdxl": write_sdxl_folder, "z_image": write_zimage_files,
           "qwen_image": write_qwen_image_folder, "wan": write_wan_folder,
           "hunyuan_video": write_hunyuan_video_files}


# --- pieces of a diffusers folder ---------------------------------------------------------------------
def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def _diffusers_version() -> dict:
    import diffusers
    return {"_diffusers_version": diffusers.__version__}


def _write_model_index(folder: Path, pipeline: str, components: dict) -> None:
    _write_json(folder / "model_index.json", {"_class_name": pipeline, **_diffusers_version(), **components})


def _write_weights(module, path: Path, device: str) -> None:
    """``module``'s state dict (a meta module), randomly initialised, in bfloat16."""
    import torch

    from pipetrain.backend.models.tiny import write_safetensors

    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(module, path, torch.bfloat16, 0, {"format": "pt"}, device=device)


def _write_diffusers_component(folder: Path, cls: type, config: dict, device: str) -> None:
    import torch

    with torch.device("meta"):
        module = cls(**config)
    _write_diffusers_weights(folder, module, config, device)


def _write_diffusers_weights(folder: Path, module, config: dict, device: str) -> None:
    _write_json(folder / "config.json", {"_class_name": type(module).__name__, **_diffusers_version(), **config})
    _write_weights(module, folder / "diffusion_pytorch_model.safetensors", device)


def _write_transformers_component(folder: Path, cls: type, config, device: str) -> None:
    import torch

    with torch.device("meta"):
        module = cls(config)
    config.save_pretrained(folder)
    _write_weights(module, folder / "model.safetensors", device)


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


def write_umt5_stand_in_tokenizer(folder: Path, text: str) -> None:
    """A fast tokenizer in UMT5's place: T5's special ids, then one id per word of ``text`` (others: unknown),
    and the end token after each text, as T5 adds it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = sorted(set(text.split()))
    vocab = {**UMT5_SPECIAL_IDS, **{word: len(UMT5_SPECIAL_IDS) + i for i, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                             special_tokens=[("</s>", UMT5_SPECIAL_IDS["</s>"])])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": WAN_TEXT_LEN})
