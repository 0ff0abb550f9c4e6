"""Pieces of diffusion-pipe-style config files shared by the compatibility tests: our own TOML, in the key
structure of diffusion-pipe's examples/main_example.toml."""

# examples/main_example.toml's top-level keys (its commented-out keys left out as it leaves them out)
DP_MAIN = """
output_dir = 'out'
dataset = 'dataset.toml'
epochs = 1000
micro_batch_size_per_gpu = 1
pipeline_stages = 1
gradient_accumulation_steps = 1
gradient_clipping = 1.0
warmup_steps = 100
eval_every_n_epochs = 1
eval_before_first_step = true
eval_micro_batch_size_per_gpu = 1
eval_gradient_accumulation_steps = 1
save_every_n_epochs = 2
checkpoint_every_n_minutes = 120
activation_checkpointing = true
partition_method = 'parameters'
save_dtype = 'bfloat16'
caching_batch_size = 1
steps_per_print = 1
video_clip_mode = 'single_beginning'
"""

DP_OPTIMIZER = """
[optimizer]
type = 'adamw_optimi'
lr = 2e-5
betas = [0.9, 0.99]
weight_decay = 0.01
eps = 1e-8
"""

DP_MONITORING = """
[monitoring]
enable_wandb = false
wandb_api_key = ''
wandb_tracker_name = ''
wandb_run_name = ''
"""

# examples/dataset.toml's bucket settings (num_ar_buckets and the rest vary between the examples)
DP_AR_BUCKETS = """
resolutions = [512]
enable_ar_bucket = true
min_ar = 0.5
max_ar = 2.0
"""


# --- the tiny model files (conftest's ``model_files``) in the layouts diffusion-pipe reads ---------------------------
# Hugging Face config.json of each text-encoder kind: what tells a folder's kind (``model_folders.text_encoder_kind``)
HF_TEXT_CONFIGS = {
    "clip_l": {"model_type": "clip_text_model", "hidden_size": 768},
    "clip_g": {"model_type": "clip_text_model", "hidden_size": 1280},
    "t5xxl": {"model_type": "t5", "feed_forward_proj": "gated-gelu"},
    "umt5xxl": {"model_type": "umt5", "feed_forward_proj": "gated-gelu"},
    "qwen25_7b": {"model_type": "qwen2_5_vl", "text_config": {"hidden_size": 3584}},
    "qwen25_3b": {"model_type": "qwen2_5_vl", "text_config": {"hidden_size": 2048}},
    "llama": {"model_type": "llama"},
}
PIPELINE_CLASSES = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline", "sdxl": "StableDiffusionXLPipeline",
                    "sd15": "StableDiffusionPipeline", "qwen_image": "QwenImagePipeline", "ltx_video": "LTXPipeline",
                    "hidream": "HiDreamImagePipeline", "omnigen2": "OmniGen2Pipeline"}
# text-encoder folders a pipeline names after their role instead of text_encoder, text_encoder_2, ...
TEXT_ENCODER_FOLDERS = {"omnigen2": ("mllm",)}


def _place(source, target) -> None:
    """``source`` at ``target`` (a hard link: the tiny files are shared, read-only; a copy across file systems)."""
    import os
    import shutil
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy(source, target)


def diffusers_folder(files, folder, arch: str):
    """A Diffusers pipeline folder (diffusion-pipe's ``diffusers_path`` / ``checkpoint_path``) of the tiny files of
    ``arch``: model_index.json, ``transformer/`` (``unet/`` for SDXL / SD1.5), ``vae/`` and ``text_encoder*/``, each
    file one shard beside a Hugging Face config.json. The shards keep the tiny files' keys and metadata (ComfyUI's
    detection reads either), so it is what check-config reads, not what diffusers would load."""
    import json

    from pipetrain.backend.config.model_folders import safetensors_header
    from pipetrain.backend.models.loading import META_TE_KIND
    unet = "unet" if arch in ("sdxl", "sd15") else "transformer"
    _place(files.diffusion_model, folder / unet / "diffusion_pytorch_model.safetensors")
    _place(files.vae, folder / "vae" / "diffusion_pytorch_model.safetensors")
    names = TEXT_ENCODER_FOLDERS.get(arch) or ["text_encoder" if i == 0 else f"text_encoder_{i + 1}"
                                               for i in range(len(files.text_encoders))]
    for name, path in zip(names, files.text_encoders):
        sub = folder / name
        _place(path, sub / "model.safetensors")
        kind = safetensors_header(path)[1][META_TE_KIND]
        (sub / "config.json").write_text(json.dumps(HF_TEXT_CONFIGS[kind]))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": PIPELINE_CLASSES[arch]}))
    return folder


def wan_checkpoint_folder(files, folder):
    """Wan's official checkpoint folder (diffusion-pipe's ``ckpt_path``) of the tiny Wan: its transformer shard and
    its VAE as ``Wan2.1_VAE.pth`` (a pickle: check-config notes it unread)."""
    import torch

    from pipetrain.backend.models.loading import _load_state_dict
    _place(files.diffusion_model, folder / "diffusion_pytorch_model.safetensors")
    torch.save(_load_state_dict(files.vae)[0], folder / "Wan2.1_VAE.pth")
    return folder


# --- every key diffusion-pipe (8f83dbf) reads, with a value it reads and, for [model] keys, the type it reads them
# for: its train.py, utils/saver.py, utils/dataset.py, models/*.py and optimizers/ (docs/dp_keys.md is generated
# from these by check_config.dp_key_table; tests/unit/test_dp_keys_table.py checks it) ----------------------------
DP_KEYS = [
    # main file, top level
    *(("main", k, v, None) for k, v in (
        ("output_dir", "out"), ("dataset", "dataset.toml"), ("eval_datasets", ["eval.toml"]),
        ("epochs", 1000), ("max_steps", 100), ("micro_batch_size_per_gpu", 1), ("image_micro_batch_size_per_gpu", 4),
        ("pipeline_stages", 1), ("gradient_accumulation_steps", 1), ("gradient_clipping", 1.0), ("warmup_steps", 100),
        ("force_constant_lr", 1e-5), ("lr_scheduler", "constant"), ("blocks_to_swap", 0), ("pseudo_huber_c", 0.5),
        ("eval_every_n_epochs", 1), ("eval_every_n_steps", 100), ("eval_every_n_examples", 1000),
        ("eval_before_first_step", True), ("eval_micro_batch_size_per_gpu", 1),
        ("image_eval_micro_batch_size_per_gpu", 4), ("eval_image_micro_batch_size_per_gpu", 4),
        ("eval_gradient_accumulation_steps", 1), ("disable_block_swap_for_eval", False),
        ("save_every_n_epochs", 2), ("save_every_n_steps", 100), ("save_every_n_examples", 1000),
        ("checkpoint_every_n_epochs", 1), ("checkpoint_every_n_minutes", 120), ("activation_checkpointing", True),
        ("reentrant_activation_checkpointing", False), ("partition_method", "parameters"),
        ("partition_split", [10]), ("save_dtype", "bfloat16"), ("caching_batch_size", 1), ("map_num_proc", 8),
        ("compile", False), ("steps_per_print", 1), ("video_clip_mode", "single_beginning"),
        ("x_axis_examples", False), ("logging_steps", 1), ("uncond_fraction", 0.0), ("huber_delta", 1.0),
        ("smooth_l1_beta", 1.0), ("resume_from_checkpoint", True), ("regenerate_cache", False))),
    *(("monitoring", k, v, None) for k, v in (("enable_wandb", False), ("wandb_api_key", ""),
                                               ("wandb_tracker_name", ""), ("wandb_run_name", ""))),
    # [model]: every model's keys, then each model's own
    *(("model", k, v, "flux") for k, v in (
        ("type", "flux"), ("dtype", "bfloat16"), ("transformer_dtype", "float8"), ("diffusion_model_dtype", "float8"),
        ("timestep_sample_method", "logit_normal"), ("sigmoid_scale", 1.0), ("shift", 3.0), ("flux_shift", True),
        ("guidance", 1.0), ("cache_text_embeddings", True), ("merge_adapters", ["a.safetensors"]),
        ("diffusion_model", "m.safetensors"), ("vae", "v.safetensors"), ("text_encoders", ["t.safetensors"]),
        ("transformer_path", "m.safetensors"), ("vae_path", "v.safetensors"), ("diffusers_path", "FLUX.1-dev"),
        ("bypass_guidance_embedding", False))),
    ("model", "llm_path", "llava.safetensors", "hunyuan-video"), ("model", "clip_path", "clip.safetensors", "hunyuan-video"),
    ("model", "ckpt_path", "HunyuanVideo", "hunyuan-video"),
    ("model", "text_encoder_path", "t.safetensors", "cosmos"), ("model", "t5_path", "t5.safetensors", "cosmos_predict2"),
    ("model", "byt5_path", "byt5.safetensors", "hunyuan_image"), ("model", "checkpoint_path", "sdxl.safetensors", "sdxl"),
    *(("model", k, v, "sdxl") for k, v in (("unet_lr", 4e-5), ("text_encoder_1_lr", 0), ("text_encoder_2_lr", 0),
                                           ("v_pred", False), ("min_snr_gamma", 5.0),
                                           ("debiased_estimation_loss", True))),
    *(("model", k, v, "wan") for k, v in (("min_t", 0.0), ("max_t", 1.0))),
    *(("model", k, v, "cosmos_predict2") for k, v in (("llm_adapter_lr", 0), ("llm_adapter_path", "a.safetensors"))),
    ("model", "first_frame_conditioning_p", 1.0, "ltx-video"), ("model", "single_file_path", "ltx.safetensors", "ltx-video"),
    ("model", "max_llama3_sequence_length", 128, "hidream"), ("model", "llama3_path", "Llama-3.1-8B", "hidream"),
    ("model", "max_sequence_length", 768, "auraflow"), ("model", "lumina_shift", True, "lumina_2"),
    # [adapter]
    *(("adapter", k, v, None) for k, v in (
        ("type", "lora"), ("rank", 32), ("alpha", 32), ("dtype", "bfloat16"), ("dropout", 0.0),
        ("decompose_factor", -1), ("rank_dropout", 0.0), ("init_from_existing", "epoch10"),
        ("exclude_modules", ["proj_out"]), ("fuse_adapters", []))),
    # [optimizer] (its other keys go to the optimizer's constructor)
    *(("optimizer", k, v, None) for k, v in (
        ("type", "adamw_optimi"), ("lr", 2e-5), ("betas", [0.9, 0.99]), ("weight_decay", 0.01), ("eps", 1e-8),
        ("gradient_release", False), ("beta2_half_life", 100), ("stabilize", False))),
    # dataset file, top level (each also per [[directory]])
    *(("dataset", k, v, None) for k, v in (
        ("resolutions", [512]), ("enable_ar_bucket", True), ("min_ar", 0.5), ("max_ar", 2.0), ("num_ar_buckets", 7),
        ("ar_buckets", [1.0]), ("frame_buckets", [1, 33]), ("size_buckets", [[512, 512]]), ("cache_shuffle_num", 0),
        ("cache_shuffle_delimiter", ", "), ("shuffle_tags", False), ("caption_prefix", ""), ("num_repeats", 1),
        ("shuffle_metadata", True), ("skip_empty_caption", True), ("online_captions", False),
        ("subsample_ratio", 0.5))),
    *(("directory", k, v, None) for k, v in (
        ("path", "images"), ("mask_path", "masks"), ("control_path", "control"), ("default_mask_file", "mask.png"),
        ("num_repeats", 1), ("resolutions", [512]), ("frame_buckets", [1, 33]), ("caption_prefix", ""),
        ("enable_ar_bucket", True), ("min_ar", 0.5), ("max_ar", 2.0), ("num_ar_buckets", 7), ("ar_buckets", [1.0]),
        ("size_buckets", [[512, 512]]))),
]
