"""diffusion-pipe's spellings and the keys PipeTrain knows but does not act on (reason and fix for each).

A diffusion-pipe main + dataset TOML pair loads as is when it trains a model PipeTrain supports from ComfyUI
single files or from a model folder ComfyUI converts (``compat_folders``: ``diffusers_path`` / ``checkpoint_path``
for Flux, SD3, SDXL, SD1.5, a Flux folder's VAE and T5 for Chroma, ``ckpt_path`` for Wan): keys with the same meaning are config fields (``backend/config``);
diffusion-pipe's other names for them (its type strings, ``transformer_path`` & co., ``transformer_dtype``, its
folder keys) are rewritten by the ``preprocess_*`` hooks; its edit models (``flux`` / ``qwen_image`` with control
images) are mapped by ``edit_type`` once the dataset is read; keys whose value changes nothing here (``inert``
values, e.g. ``compile = false``) are accepted and dropped; any other value of a key listed here fails naming the
key and the fix. A key in neither place is a typo and fails listing the accepted keys. ``commands/check_config.py``
reports all of this for one config pair.
"""
from __future__ import annotations

import math

from . import compat_folders as model_folders
from ..errors import ConfigError
from .schema import ANY, Unsupported

SINGLE_FILES_HINT = model_folders.SINGLE_FILES_HINT

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
    "regenerate_cache": Unsupported("diffusion-pipe ignores this key too (its command-line flag always wins); "
                                    "pass --regenerate-cache on the command line", inert=ANY),
    # read by the train command itself (dp_cli.config_resume), before the config loads: dropped here
    "resume_from_checkpoint": Unsupported("true (the newest run) or a run's folder name in output_dir",
                                          inert=lambda v: isinstance(v, (bool, str))),
}



def type_aliases() -> dict[str, str]:
    """diffusion-pipe's type strings that name a model type here by another spelling (the adapters' ``dp_aliases``)."""
    from ..models.registry import dp_facts
    return {alias: t for t, aliases in dp_facts("dp_aliases").items() for alias in aliases}


def edit_types() -> dict[str, str]:
    """diffusion-pipe declares an edit model as its base type plus a dataset with control images (control_path):
    its type -> ours (the adapters' ``dp_edit_of``)."""
    from ..models.registry import dp_facts
    return {base: t for t, base in dp_facts("dp_edit_of").items()}


def file_types() -> dict[str, tuple[str, ...]]:
    """diffusion-pipe's types that name several of ours, told apart by the diffusion model's file as diffusion-pipe
    tells them (its Flux 2 type is dev or a Klein by the file's widths): its type -> the other types of ours,
    whose adapters' ``claims_file`` read the header (the adapters' ``dp_file_of``)."""
    from ..models.registry import dp_facts
    out: dict[str, tuple[str, ...]] = {}
    for t, base in dp_facts("dp_file_of").items():
        out[base] = (*out.get(base, ()), t)
    return out


def first_frame_types() -> dict[str, str]:
    """diffusion-pipe's types whose ``first_frame_conditioning_p`` = 1 trains every clip with its first frame given:
    its type -> ours (the adapters' ``dp_first_frame_of``)."""
    from ..models.registry import dp_facts
    return {base: t for t, base in dp_facts("dp_first_frame_of").items()}


def reads_llama3_path(model_type) -> bool:
    """diffusion-pipe's HiDream reads llama3_path, a Hugging Face Llama folder, as its Llama text encoder (the
    adapters' ``dp_llama3_path``)."""
    from ..models.registry import dp_facts
    return model_type in dp_facts("dp_llama3_path")


def reads_fuse_adapters(model_type) -> bool:
    """diffusion-pipe's Flux and Chroma fuse ``[adapter] fuse_adapters`` into the base weights before training; its
    other models ignore the key (the adapters' ``dp_fuse_adapters``)."""
    from ..models.registry import dp_facts
    return type_aliases().get(model_type, model_type) in dp_facts("dp_fuse_adapters")


FUSE_ADAPTERS_LINE = ("DIFFERENT: read as [model] merge_adapters, each LoRA merged at its weight by ComfyUI's LoRA "
                      "maths into the weights as loaded (diffusion-pipe: by Diffusers' into its bfloat16 weights "
                      "before a float8 cast); the same sums, rounded once more where the weights are float8")


def reads_lumina_shift(model_type) -> bool:
    """diffusion-pipe's Lumina 2 reads lumina_shift: Flux's resolution-dependent shift (our flux_shift), on the same
    token count; its other models ignore the key (the adapters' ``dp_lumina_shift``)."""
    from ..models.registry import dp_facts
    return model_type in dp_facts("dp_lumina_shift")

# diffusion-pipe's other names for our keys: its single-file keys (ComfyUI files), and transformer_dtype (its
# name for diffusion_model_dtype on its older models)
MODEL_RENAMES = {"transformer_path": "diffusion_model", "vae_path": "vae", "transformer_dtype": "diffusion_model_dtype"}
# diffusion-pipe's model-folder keys (``compat_folders``), as check-config describes them
FOLDER_KEYS = model_folders.FOLDER_KEYS   # read for the model types ``model_folders.folder_types`` names
# both spellings diffusion-pipe's code and its example read
RUN_RENAMES = {"image_eval_micro_batch_size_per_gpu": "eval_image_micro_batch_size_per_gpu"}
# diffusion-pipe's micro-batch keys that take a per-resolution list [[resolution, batch], ...] (training and eval):
# the list is kept under our key of the same name with _by_resolution for _per_gpu, the first batch (what DeepSpeed
# records) under the key itself
PER_RESOLUTION_KEYS = {key: key.replace("_per_gpu", "_by_resolution") for key in (
    "micro_batch_size_per_gpu", "image_micro_batch_size_per_gpu", "eval_micro_batch_size_per_gpu",
    "eval_image_micro_batch_size_per_gpu")}
# its text-encoder file keys, in the order the model types here list their text encoders (the LLM / T5 first,
# then CLIP-L or ByT5: HunyuanVideo is llm_path + clip_path, HunyuanImage 2.1 text_encoder_path + byt5_path)
TEXT_ENCODER_KEYS = ("llm_path", "text_encoder_path", "t5_path", "clip_path", "byt5_path")

# Defaults that differ from diffusion-pipe's, for keys a file leaves out: (file, key, diffusion-pipe, PipeTrain).
# docs/config.md's table lists the same rows.
DEFAULT_DIFFERENCES = [
    ("main", "epochs", "required", "10"),
    ("main", "save_every_n_epochs", "one save_every_* key required", "1"),
    ("main", "partition_method", "'parameters'", "'compute' (stages balanced by per-layer compute estimates)"),
    ("main", "model.dtype", "required", "'bfloat16'"),
    ("main", "adapter.dtype", "the model's dtype", "'float32'"),
    ("main", "adapter.alpha", "the key is refused (alpha = rank)", "rank (the key is allowed)"),
    ("main", "save_dtype", "the trained weights' dtype (adapter.dtype)", "float32 for adapters, the model's dtype "
     "for a full fine-tune"),
    ("dataset", "resolutions", "required", "[512]"),
    ("dataset", "min_ar, max_ar, num_ar_buckets", "required with enable_ar_bucket = true", "0.5, 2.0, 7"),
    ("dataset", "skip_empty_caption", "true (its docs say false)", "false: an image without a caption trains "
     "with the empty caption"),
    ("dataset", "shuffle_metadata", "true", "the order is reshuffled every epoch (the key changes nothing)"),
]

# Keys (dotted under their table) whose values mean something else here (check-config shows them where a file
# sets them)
MEANING_DIFFERENCES = {
    "lr_scheduler": "'linear' and 'cosine' decay to 0 at the run's last step (diffusion-pipe: over the epochs, "
                    "cosine to 1e-6)",
    "partition_split": "layer indices of PipeTrain's layer list (a different list from diffusion-pipe's)",
    "model.min_t": "every flow model draws its timesteps in [min_t, max_t] (diffusion-pipe reads it for Wan only)",
    "model.max_t": "every flow model draws its timesteps in [min_t, max_t] (diffusion-pipe reads it for Wan only)",
    "subsample_ratio": "each epoch trains the first int(global batches x ratio) of its own shuffled global batches, "
                       "another share every epoch (diffusion-pipe: the same share every epoch, its order being fixed)",
    "model.debiased_estimation_loss": "false is off (diffusion-pipe weighs the loss whenever the key is present, "
                                      "false included)",
}

# keys whose value is a file or folder path (any table): a relative one is read from the folder of the file that
# names it, or from the working directory where only that holds it (diffusion-pipe: always the working directory);
# check-config says which
PATH_KEYS = {"output_dir", "dataset", "config", "lora_dir", "hostfile", "diffusion_model", "vae", "text_encoders",
             "path", "paths", "clip_vision", "merge_adapters", "init_from_existing", "mask_path", "default_mask_file",
             "control_path", "control_mask_path", "reference_path", "start_image", "end_image", "control_video",
             "llama3_path",
             *MODEL_RENAMES.keys() - {"transformer_dtype"}, *TEXT_ENCODER_KEYS, *model_folders.FOLDER_KEYS}

MODEL = {
    # read for the types reads_llama3_path names (preprocess_model); diffusion-pipe's other models ignore it
    "llama3_path": Unsupported("diffusion-pipe reads it for hidream only", inert=ANY),
    **{key: Unsupported(f"not read by PipeTrain. {SINGLE_FILES_HINT}")
       for key in ("text_encoder", "audio_vae", "llm_adapter_path")},
    "cache_text_embeddings": Unsupported("text embeddings are always cached", inert=(True,)),
    "lumina_shift": Unsupported("diffusion-pipe reads it for lumina_2 only (flux_shift is the same shift for the "
                                "other flow models)", inert=ANY),
    "bypass_guidance_embedding": Unsupported("not implemented", inert=(False,)),
    "llm_adapter_lr": Unsupported("Anima's LLM adapter stays frozen here (LoRA trains its DiT blocks); set it to 0, "
                                  "or remove the key", inert=(0, 0.0)),
    # diffusion-pipe's SDXL trains LoRAs on both text encoders at these rates (default [optimizer] lr); here they
    # stay frozen, which a rate of 0 means there
    "text_encoder_1_lr": Unsupported("text encoders are not trained here (diffusion-pipe trains SDXL's at this "
                                     "rate): set it to 0, or remove the key", inert=(0, 0.0)),
    "text_encoder_2_lr": Unsupported("text encoders are not trained here (diffusion-pipe trains SDXL's at this "
                                     "rate): set it to 0, or remove the key", inert=(0, 0.0)),
}

ADAPTER = {
    "rank_dropout": Unsupported("LoKr's rank dropout is not implemented; use dropout (on the adapter's input)",
                                inert=(0, 0.0)),
    # read for the types reads_fuse_adapters names (preprocess_run); diffusion-pipe's other models ignore it
    "fuse_adapters": Unsupported("diffusion-pipe fuses them for flux and chroma only", inert=ANY),
}

OPTIMIZER = {
    "gradient_release": Unsupported("not implemented; remove the key", inert=(False,)),
    # diffusion-pipe's AdamW8bitKahan argument: false (its default) is plain AdamW, as here
    "stabilize": Unsupported("StableAdamW's update scaling is not implemented for AdamW8bitKahan; set "
                             "stabilize = false, or use type = 'stableadamw' (optimi's StableAdamW, with Kahan "
                             "summation for bf16 weights)", inert=(False,)),
}

_DATASET_COMMON = {
    "shuffle_metadata": Unsupported("the order is reshuffled every epoch anyway", inert=ANY),
    "online_captions": Unsupported("captions are always cached as embeddings", inert=(False,)),
}
DATASET = {
    **_DATASET_COMMON,
    "control_path": Unsupported("set control_path in each [[directory]] of an edit model's dataset"),
    "mask_path": Unsupported("set mask_path in each [[directory]] whose images have masks"),
    "default_mask_file": Unsupported("set default_mask_file in each [[directory]] it applies to"),
}
DIRECTORY = {
    **_DATASET_COMMON,
    "subsample_ratio": Unsupported("diffusion-pipe reads it at the top of the dataset file only (it ignores it in a "
                                   "[[directory]]); set it there to train a share of each epoch", inert=ANY),
}

OPTIMIZER_NOT_SUPPORTED = {
    "offload": "CPU-offloaded AdamW is not supported; use 'adamw8bit' to save optimizer memory",
    "genericoptim": "diffusion-pipe's own optimizer; any pytorch_optimizer class works by name (e.g. 'Prodigy', "
                    "'CAME', 'ADOPT')",
}


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def preprocess_run(data: dict, file, prefix: str) -> dict:
    for alias, target in RUN_RENAMES.items():
        _rename(data, alias, target, file, prefix)
    for key in PER_RESOLUTION_KEYS:
        if isinstance(data.get(key), list):
            pairs = data[key]
            if not pairs or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(v, int) for v in p)
                                    for p in pairs):
                raise ConfigError(f"got {pairs!r}; give one integer or [[resolution, batch], ...], e.g. "
                                  "[[512, 4], [1024, 1]]", file=file, key=_key(prefix, key))
            data = {**data, key: pairs[0][1], PER_RESOLUTION_KEYS[key]: pairs}
    if ("save_every_n_steps" in data or "save_every_n_examples" in data) and "save_every_n_epochs" not in data:
        data["save_every_n_epochs"] = None   # as in diffusion-pipe: saving by steps alone means no epoch saves
    return _fuse_adapters(data, file, prefix)


def _fuse_adapters(data: dict, file, prefix: str) -> dict:
    """diffusion-pipe's ``[adapter] fuse_adapters = [{path, weight}]`` on the types that read it: the same LoRAs,
    merged at the same weights, as ``[model] merge_adapters`` tables."""
    adapter, model = data.get("adapter"), data.get("model")
    if not (isinstance(adapter, dict) and "fuse_adapters" in adapter and isinstance(model, dict)
            and reads_fuse_adapters(model.get("type"))):
        return data
    key = _key(prefix, "adapter.fuse_adapters")
    fuse = adapter["fuse_adapters"]
    if not isinstance(fuse, list) or not all(isinstance(e, dict) for e in fuse):
        raise ConfigError("give a list of tables, e.g. [{path = 'lora.safetensors', weight = 1.0}]", file=file,
                          key=key)
    for i, entry in enumerate(fuse):
        extra = sorted(set(entry) - {"path", "weight"})
        if not isinstance(entry.get("path"), str) or extra:
            raise ConfigError(f"each entry is {{path = '...', weight = 1.0}} (weight optional); entry {i} "
                              + (f"has {extra[0]!r}" if extra else "has no path"), file=file, key=f"{key}[{i}]")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError("a weight is a number (1.0: the LoRA as trained)", file=file, key=f"{key}[{i}].weight")
    if model.get("merge_adapters"):
        raise ConfigError("give [model] merge_adapters or [adapter] fuse_adapters, not both (the same setting)",
                          file=file, key=key)
    merged = [{"path": e["path"], "weight": float(e.get("weight", 1.0))} for e in fuse]
    return {**data, "adapter": {k: v for k, v in adapter.items() if k != "fuse_adapters"},
            "model": {**model, "merge_adapters": merged}}


def _rename(data: dict, alias: str, target: str, file, prefix: str) -> None:
    """diffusion-pipe's ``alias`` key is our ``target``; giving both fails."""
    if alias in data:
        if target in data:
            raise ConfigError(f"give {target} or {alias}, not both (the same setting)", file=file,
                              key=_key(prefix, alias))
        data[target] = data.pop(alias)


def preprocess_model(data: dict, file, prefix: str) -> dict:
    if isinstance(data.get("type"), str):
        data["type"] = type_aliases().get(data["type"], data["type"])
    if "first_frame_conditioning_p" in data and data.get("type") in first_frame_types():
        _first_frame_conditioning(data, file, prefix)
    for alias, target in MODEL_RENAMES.items():
        _rename(data, alias, target, file, prefix)
    if reads_lumina_shift(data.get("type")):
        _rename(data, "lumina_shift", "flux_shift", file, prefix)
    given = [k for k in TEXT_ENCODER_KEYS if k in data]
    if given:
        if "text_encoders" in data:
            raise ConfigError(f"give text_encoders or {' and '.join(given)}, not both (the same files)", file=file,
                              key=_key(prefix, given[0]))
        data["text_encoders"] = [data.pop(k) for k in given]
    model_folders.expand(data, file, prefix)
    if "llama3_path" in data and reads_llama3_path(data.get("type")):
        # HiDream's fourth text encoder, after the other three (which diffusion-pipe takes from diffusers_path)
        given = data.get("text_encoders", [])
        data["text_encoders"] = [*(given if isinstance(given, list) else [given]), data.pop("llama3_path")]
    return data


def _first_frame_conditioning(data: dict, file, prefix: str) -> None:
    """diffusion-pipe's ``first_frame_conditioning_p`` (LTX-Video's): the share of clips trained with their first
    frame given. Every clip (1) is the type ``first_frame_types`` names (``ltx_video_i2v``), none (0) the table's
    own; a share of them is not built (a run here trains one mode)."""
    p = data.pop("first_frame_conditioning_p")
    given = first_frame_types()[data["type"]]
    if p == 1:
        data["type"] = given
    elif p != 0:
        raise ConfigError(f"got {p!r}; a run here trains every clip with its first frame given or none: set "
                          f"type = {given!r} (or first_frame_conditioning_p = 1.0) for image to video, or "
                          "remove the key for text to video", file=file, key=_key(prefix, "first_frame_conditioning_p"))


def file_type(model_type: str, diffusion_model) -> str:
    """The model type a diffusion-pipe type string trains with this diffusion-model file (``file_types``): the
    first of its other types whose adapter claims the file's safetensors header, else ``model_type``. A file that
    cannot be read here (missing, a folder, pickled) keeps the type: the model-file checks name the problem."""
    from pathlib import Path

    from ..errors import ModelError
    from .model_folders import safetensors_header

    path = Path(diffusion_model)
    others = file_types().get(model_type)
    if not others or not path.is_file() or path.suffix.lower() != ".safetensors":
        return model_type
    try:
        shapes, metadata = safetensors_header(path)
    except ModelError:
        return model_type
    from ..models.registry import adapter_class

    return next((t for t in others if adapter_class(t).claims_file(shapes, metadata)), model_type)


def edit_type(model_type: str, has_control: bool) -> str:
    """The model type a run trains: diffusion-pipe's ``flux`` / ``qwen_image`` with control images in the
    dataset (``control_path``) is Flux Kontext / Qwen-Image-Edit; its ``flux2`` with them is Flux 2 edit."""
    return edit_types().get(model_type, model_type) if has_control else model_type


def preprocess_adapter(data: dict, file, prefix: str) -> dict:
    """A whole-number float ``rank`` (diffusion-pipe's ``rank = 1e6``: LoKr's full-matrix second factor, which any
    rank above half the layer's width gives here too) is that integer."""
    rank = data.get("rank")
    if isinstance(rank, float):
        if not rank.is_integer():
            raise ConfigError(f"got {rank}; a rank is a whole number (1e6 for LoKr's full matrix)", file=file,
                              key=_key(prefix, "rank"))
        data = {**data, "rank": int(rank)}
    return data


def preprocess_dataset(data: dict, file, prefix: str) -> dict:
    """diffusion-pipe's [width, height] forms: a resolution pair is the square side of the same area (rounded to
    a multiple of 16), an ar_buckets pair the ratio width / height."""
    out = dict(data)
    if isinstance(data.get("resolutions"), list):
        out["resolutions"] = [_pair(r, file, _key(prefix, f"resolutions[{i}]"), lambda w, h: 16 * round(
            math.sqrt(w * h) / 16)) for i, r in enumerate(data["resolutions"])]
    if isinstance(data.get("ar_buckets"), list):
        out["ar_buckets"] = [_pair(a, file, _key(prefix, f"ar_buckets[{i}]"), lambda w, h: w / h, number=float)
                             for i, a in enumerate(data["ar_buckets"])]
    return out


def _pair(value, file, key: str, convert, number=int):
    if not isinstance(value, list):
        return number(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        return convert(*value)
    raise ConfigError(f"got {value!r}; a pair is [width, height] in whole pixels", file=file, key=key)
