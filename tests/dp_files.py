"""Pieces of diffusion-pipe-style config files shared by the compatibility tests: our own TOML, in the key
structure of diffusion-pipe's examples/main_example.toml."""

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
}
PIPELINE_CLASSES = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline", "sdxl": "StableDiffusionXLPipeline",
                    "sd15": "StableDiffusionPipeline", "qwen_image": "QwenImagePipeline"}


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
    for i, path in enumerate(files.text_encoders):
        sub = folder / ("text_encoder" if i == 0 else f"text_encoder_{i + 1}")
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
