"""diffusion-pipe keys PipeTrain knows but does not act on, each with the reason and what to do instead.

A diffusion-pipe main + dataset TOML pair loads as is when it trains a model PipeTrain supports: keys
with the same meaning are config fields (``config.py``); keys whose value changes nothing here (``inert``
values, e.g. ``compile = false``) are accepted and dropped;
any other value of a key listed here fails naming the key and the fix. A key in neither place is a
typo and fails listing the accepted keys.
"""
from __future__ import annotations

import math

from .errors import ConfigError
from .schema import ANY, Unsupported

SINGLE_FILES_HINT = ("PipeTrain loads single-file ComfyUI weights: set diffusion_model = "
                     "'<diffusion model>.safetensors' (ComfyUI's models/diffusion_models), vae = '<vae>.safetensors' "
                     "(models/vae) and text_encoders = ['<text encoder>.safetensors', ...] (models/text_encoders) "
                     "instead")

RUN = {
    "disable_block_swap_for_eval": Unsupported("eval swaps blocks as training does", inert=ANY),
    "x_axis_examples": Unsupported("TensorBoard's x-axis is the optimizer step; remove the key", inert=(False,)),
    "reentrant_activation_checkpointing": Unsupported(
        "activation_checkpointing = true recomputes as reentrant checkpointing does (the block runs without "
        "autograd, and again in backward)", inert=ANY),
    "map_num_proc": Unsupported("caching is split over the ranks instead", inert=ANY),
    "video_clip_mode": Unsupported("a video trains as one clip from its start (diffusion-pipe's default, "
                                   "'single_beginning')", inert=("single_beginning",)),
    "logging_steps": Unsupported("every step is logged", inert=ANY),
    "pseudo_huber_c": Unsupported("diffusion-pipe ignores it too", inert=ANY),
    "regenerate_cache": Unsupported("pass --regenerate-cache on the command line (diffusion-pipe ignores this "
                                    "key too)", inert=(False,)),
    "resume_from_checkpoint": Unsupported("pass --resume [RUN] on the command line", inert=(False,)),
    "force_constant_lr": Unsupported("set [optimizer] lr and lr_scheduler = 'constant' (a resumed run keeps "
                                     "the checkpoint's schedule)"),
    "huber_delta": Unsupported("PipeTrain trains with the mean squared error; remove the key"),
    "smooth_l1_beta": Unsupported("PipeTrain trains with the mean squared error; remove the key"),
    "monitoring": Unsupported("Weights & Biases is not supported; the run logs to TensorBoard "
                              "(<run>/tensorboard) and events.jsonl; set enable_wandb = false or remove [monitoring]",
                              inert=lambda v: isinstance(v, dict) and not v.get("enable_wandb", False)),
}

MODEL = {
    **{key: Unsupported(f"a path in a format PipeTrain cannot load. {SINGLE_FILES_HINT}")
       for key in ("diffusers_path", "transformer_path", "ckpt_path", "vae_path", "llm_path", "clip_path",
                   "t5_path", "text_encoder_path", "text_encoder", "audio_vae", "llm_adapter_path")},
    "checkpoint_path": Unsupported(f"a combined checkpoint (UNet + VAE + text encoders in one file) is not read. "
                                   f"{SINGLE_FILES_HINT}"),
    "cache_text_embeddings": Unsupported("text embeddings are always cached", inert=(True,)),
    "bypass_guidance_embedding": Unsupported("not implemented", inert=(False,)),
    "min_snr_gamma": Unsupported("not implemented; remove the key"),
    "debiased_estimation_loss": Unsupported("not implemented; remove the key", inert=(False,)),
    "unet_lr": Unsupported("one learning rate for everything that trains: set [optimizer] lr"),
    "text_encoder_1_lr": Unsupported("text encoders are not trained; remove the key"),
    "text_encoder_2_lr": Unsupported("text encoders are not trained; remove the key"),
}

ADAPTER = {
    "rank_dropout": Unsupported("LoKr's rank dropout is not implemented; use dropout (on the adapter's input)",
                                inert=(0, 0.0)),
    "exclude_modules": Unsupported("list the modules to adapt as regexes in target_modules instead"),
    "fuse_adapters": Unsupported("merge the LoRA into the base model in ComfyUI and train on the merged file"),
}

OPTIMIZER = {
    "gradient_release": Unsupported("not implemented; remove the key", inert=(False,)),
}

_MASKS = "masked training is not supported"
_DATASET_COMMON = {
    "shuffle_metadata": Unsupported("the order is reshuffled every epoch anyway", inert=ANY),
    "online_captions": Unsupported("captions are always cached as embeddings", inert=(False,)),
    "ar_buckets": Unsupported("list-style aspect-ratio buckets are not supported; use min_ar, max_ar and "
                              "num_ar_buckets (evenly spaced in log space)"),
    "size_buckets": Unsupported("explicit size buckets are not supported; use resolutions with "
                                "enable_ar_bucket, min_ar, max_ar and num_ar_buckets"),
    "mask_path": Unsupported(_MASKS),
    "default_mask_file": Unsupported(_MASKS),
}
DATASET = {
    **_DATASET_COMMON,
    "control_path": Unsupported("set control_path in each [[directory]] of an edit model's dataset"),
    "subsample_ratio": Unsupported("not implemented; use a smaller directory or num_repeats"),
}
DIRECTORY = {
    **_DATASET_COMMON,
    **{key: Unsupported("per-directory bucket settings are not supported; set it at the top of the dataset "
                        "file (or use one dataset file per setting)")
       for key in ("enable_ar_bucket", "min_ar", "max_ar", "num_ar_buckets")},
}

OPTIMIZER_NOT_SUPPORTED = {
    "offload": "CPU-offloaded AdamW is not supported; use 'adamw8bit' to save optimizer memory",
    "automagic": "diffusion-pipe's own optimizer; use 'Prodigy' for an adaptive learning rate",
    "genericoptim": "diffusion-pipe's own optimizer; any pytorch_optimizer class works by name (e.g. 'Prodigy', "
                    "'CAME', 'ADOPT')",
}


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def preprocess_run(data: dict, file, prefix: str) -> dict:
    mbs = data.get("micro_batch_size_per_gpu")
    if isinstance(mbs, list):
        raise ConfigError(f"got {mbs!r}; per-resolution batch sizes are not supported: give one integer",
                          file=file, key="micro_batch_size_per_gpu")
    # every bucket here is an image bucket, so diffusion-pipe's image batch sizes are the batch sizes
    for alias, target in (("image_micro_batch_size_per_gpu", "micro_batch_size_per_gpu"),
                          ("eval_image_micro_batch_size_per_gpu", "eval_micro_batch_size_per_gpu"),
                          ("image_eval_micro_batch_size_per_gpu", "eval_micro_batch_size_per_gpu")):
        if alias in data:
            data[target] = data.pop(alias)
    if ("save_every_n_steps" in data or "save_every_n_examples" in data) and "save_every_n_epochs" not in data:
        data["save_every_n_epochs"] = None   # as in diffusion-pipe: saving by steps alone means no epoch saves
    return data


def preprocess_model(data: dict, file, prefix: str) -> dict:
    if "transformer_dtype" in data:   # diffusion-pipe's name for the same thing on its older models
        if "diffusion_model_dtype" in data:
            raise ConfigError("give diffusion_model_dtype or transformer_dtype, not both", file=file,
                              key=_key(prefix, "transformer_dtype"))
        data["diffusion_model_dtype"] = data.pop("transformer_dtype")
    return data


def preprocess_adapter(data: dict, file, prefix: str) -> dict:
    return data


def preprocess_dataset(data: dict, file, prefix: str) -> dict:
    for i, r in enumerate(data.get("resolutions") or []):
        if isinstance(r, list):
            side = math.sqrt(r[0] * r[1]) if len(r) == 2 and all(isinstance(v, int) for v in r) else None
            hint = f" (the same area as {r[0]}x{r[1]} is about {side:.0f}^2)" if side else ""
            raise ConfigError(f"got {r!r}; give resolutions as square sides (multiples of 64), not [width, height] "
                              f"pairs{hint}", file=file, key=_key(prefix, f"resolutions[{i}]"))
    return data
