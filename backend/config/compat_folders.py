# SPDX-License-Identifier: GPL-3.0-or-later
"""diffusion-pipe's model-folder keys (``diffusers_path``, ``checkpoint_path``, ``ckpt_path``) and LTX-Video's
``single_file_path`` read as our file keys.

A folder key fills in each of ``diffusion_model``, ``vae`` and ``text_encoders`` the table leaves out with the
folder's component (as diffusion-pipe does: its ``transformer_path`` & co. override a folder's parts). The
components stay folders; the loaders (``models/loading.py``) read their shards into one state dict and hand it to
ComfyUI's own loaders, which convert the Diffusers keys, so training runs ComfyUI's model code and the LoRA has
ComfyUI's keys. Only the model types whose every component ComfyUI converts are read from a folder; for the others
the key is refused naming the single files to use.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError

SINGLE_FILES_HINT = ("PipeTrain loads single-file ComfyUI weights: set diffusion_model = "
                     "'<diffusion model>.safetensors' (ComfyUI's models/diffusion_models), vae = '<vae>.safetensors' "
                     "(models/vae) and text_encoders = ['<text encoder>.safetensors', ...] (models/text_encoders) "
                     "instead")
HINT = (f"{SINGLE_FILES_HINT} (diffusion-pipe's transformer_path, vae_path and llm_path / clip_path / "
        "text_encoder_path / t5_path name the same files)")
# Which model types read a folder key is declared on their adapter classes (``models/base.py``):
# ``dp_diffusers_folder``: a Diffusers pipeline folder ComfyUI loads whole (the transformer / UNet through
# comfy.model_detection's Diffusers conversions, the VAE through comfy.sd.VAE's, CLIP / T5 by their Hugging Face
# keys; Qwen-Image's VAE and Qwen2.5-VL are renamed to ComfyUI's keys first, ``model_folders.wan_vae_state_dict`` /
# ``qwen_vl_state_dict``). ``dp_folder_borrows``: only some parts of another model's folder (diffusion-pipe's Chroma
# table names a Flux folder for its VAE and T5, the transformer as transformer_path). ``dp_ckpt_folder``: an official
# checkpoint folder whose transformer shards and VAE .pth carry ComfyUI's keys (Wan's; its T5 .pth is the original
# code's layout, which ComfyUI does not read, so the text encoder comes from llm_path). ``dp_single_file``: its
# single-file release (single_file_path, transformer and VAE in ComfyUI's checkpoint layout) with its own Diffusers
# folder lending only the text encoder (LTX-Video's, whose Diffusers transformer and VAE ComfyUI does not read).
# Others, e.g. AuraFlow (Pile-T5), are read from single files only.
WAN_VAES = ("Wan2.1_VAE.pth", "Wan2.2_VAE.pth")
TEXT_ENCODER_HINT = "llm_path = '<umt5_xxl_fp16.safetensors>' (ComfyUI's models/text_encoders)"

SINGLE_FILE_KEY = "single_file_path"   # a single-file release, read as diffusion_model (``dp_single_file`` types)
FOLDER_KEYS = ("diffusers_path", "checkpoint_path", "ckpt_path", SINGLE_FILE_KEY)


def _facts(fact: str) -> dict:
    from ..models.registry import dp_facts   # the model types' declared facts (ARCHITECTURE.md: upward imports)
    return dp_facts(fact)


def folder_types(key: str) -> list[str]:
    """The model types that read ``key`` (one of ``FOLDER_KEYS``)."""
    if key == "ckpt_path":
        return sorted(_facts("dp_ckpt_folder"))
    single = sorted(_facts("dp_single_file"))
    if key == SINGLE_FILE_KEY:
        return single
    whole = sorted(_facts("dp_diffusers_folder"))
    return whole + sorted(_facts("dp_folder_borrows")) + single if key == "diffusers_path" else whole


def describe(key: str, model_type) -> str:
    """check-config's line for a folder key in a table of ``model_type`` (our spelling)."""
    types = folder_types(key)
    if model_type not in types:
        return f"REFUSED: read for model types {', '.join(types)} only; {HINT}"
    if key == "ckpt_path":
        return ("Wan's official checkpoint folder: its transformer shards and VAE .pth where the table names no "
                "single file for them (the text encoder comes from llm_path)")
    if key == SINGLE_FILE_KEY:
        return ("the single-file release (transformer and VAE in one file, what ComfyUI's CheckpointLoaderSimple "
                "reads), read as diffusion_model; its VAE is read from the same file where the table names no vae")
    if model_type in _facts("dp_single_file"):
        return ("a Diffusers pipeline folder lending its T5 text encoder (text_encoder/, by its Hugging Face keys) "
                "where the table names none; the transformer and VAE come from single_file_path, as diffusion-pipe "
                "reads them (ComfyUI does not read the folder's)")
    borrows = _facts("dp_folder_borrows")
    if model_type in borrows:
        return (f"a Flux Diffusers pipeline folder lending its vae and {' and '.join(borrows[model_type])} text "
                "encoder folders, converted by ComfyUI's own loaders (the diffusion model comes from transformer_path)")
    if _facts("dp_folder_pipeline").get(model_type) == "QwenImage":
        return ("a Diffusers Qwen-Image pipeline folder: its transformer (ComfyUI's keys), vae (diffusers' "
                "AutoencoderKLQwenImage, renamed to the Wan VAE keys ComfyUI loads) and Qwen2.5-VL text_encoder "
                "(renamed to ComfyUI's keys) where the table names no single file for them")
    either = " (checkpoint_path: or a combined checkpoint file, read as CheckpointLoaderSimple reads it)" \
        if key == "checkpoint_path" else ""
    return ("a Diffusers pipeline folder: its transformer/unet, vae and text encoders where the table names no "
            f"single file for them, converted by ComfyUI's own loaders{either}")


def expand(data: dict, file, prefix: str) -> None:
    if SINGLE_FILE_KEY in data:
        _single_file(data, file, prefix)
    for key in ("diffusers_path", "checkpoint_path"):
        if key in data:
            _diffusers(data, key, file, prefix)
    if "ckpt_path" in data:
        _checkpoint_folder(data, file, prefix)


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _resolve(value, file) -> Path:
    """A path as ``RunConfig.resolve`` will read it (relative to the TOML file)."""
    path = Path(str(value)).expanduser()
    return path if path.is_absolute() or file is None else Path(file).parent / path


def _folder(data: dict, key: str, file, prefix: str) -> tuple[str, Path]:
    value = data.pop(key)
    if not isinstance(value, str):
        raise ConfigError(f"got {value!r}; give the folder's path as a string", file=file, key=_key(prefix, key))
    folder = _resolve(value, file)
    if not folder.is_dir():
        kind = "a Diffusers folder or a combined checkpoint file" if key == "checkpoint_path" else "a Diffusers folder"
        what = "a file, where this key reads a Diffusers folder" if folder.is_file() else "folder not found"
        raise ConfigError(f"{folder}: {what}; give {kind}, or {HINT}", file=file, key=_key(prefix, key))
    return value, folder


def _fill(data: dict, parts: dict[str, object]) -> None:
    """The folder's parts where the table names none (diffusion-pipe's single-file keys win)."""
    for name, part in parts.items():
        if part and not data.get(name):
            data[name] = part


def _diffusers(data: dict, key: str, file, prefix: str) -> None:
    from .model_folders import pipeline_components
    model_type = data.get("type")
    if model_type not in folder_types(key):
        raise ConfigError(f"PipeTrain reads a Diffusers folder for model types {', '.join(folder_types(key))} "
                          f"(ComfyUI converts their keys); for {model_type!r} {HINT}", file=file,
                          key=_key(prefix, key))
    if key == "checkpoint_path" and isinstance(data[key], str) and _resolve(data[key], file).is_file():
        # a combined checkpoint (what CheckpointLoaderSimple reads): our diffusion_model, whose VAE and text
        # encoders are read from the same file where the table names no single file for them
        _fill(data, {"diffusion_model": data.pop(key)})
        return
    value, folder = _folder(data, key, file, prefix)
    try:
        parts = pipeline_components(folder)
    except ValueError as exc:
        raise ConfigError(f"{exc}; give the pipeline folder (with model_index.json), or {HINT}", file=file,
                          key=_key(prefix, key)) from None
    _check_pipeline_class(data, model_type, folder, file, _key(prefix, key))
    join = lambda sub: str(Path(value) / sub)  # noqa: E731  (relative stays relative to the TOML file)
    encoders = parts["text_encoders"]
    if model_type in _facts("dp_single_file"):
        taken = _lent_text_encoders(data, model_type, folder, encoders, file, _key(prefix, key))
        _fill(data, {"text_encoders": [join(sub) for sub in taken]})
        return
    if model_type in _facts("dp_folder_borrows"):
        encoders = _borrowed(data, model_type, folder, encoders, file, _key(prefix, key))
    _fill(data, {"diffusion_model": join(parts["diffusion_model"]), "vae": join(parts["vae"]),
                 "text_encoders": [join(sub) for sub in encoders]})


def _check_pipeline_class(data: dict, model_type: str, folder: Path, file, key: str) -> None:
    """Another model's folder would give a transformer of the wrong architecture: refuse it, naming the key that
    gives the right one."""
    import json
    want = _facts("dp_folder_pipeline").get(model_type)
    if want is None or data.get("diffusion_model"):
        return
    try:
        found = str(json.loads((folder / "model_index.json").read_text()).get("_class_name", ""))
    except (OSError, ValueError, AttributeError):
        found = ""
    if not found.startswith(want):
        raise ConfigError(f"{folder} is a {found or 'unknown'} folder, not a {want}*Pipeline one: give the "
                          f"{model_type} pipeline folder, or its transformer file as transformer_path = "
                          "'<file>.safetensors' (ComfyUI's models/diffusion_models)", file=file, key=key)


def _borrowed(data: dict, model_type: str, folder: Path, encoders: list[str], file, key: str) -> list[str]:
    """The text-encoder folders a ``dp_folder_borrows`` type takes from another model's pipeline folder; its
    diffusion model must come from its own file."""
    kinds, example = _facts("dp_folder_borrows")[model_type], _facts("dp_transformer_example")[model_type]
    if not data.get("diffusion_model"):
        raise ConfigError(f"this folder's transformer is not a {model_type} model: add transformer_path = "
                          f"'<{example}>' (ComfyUI's models/diffusion_models); the folder gives the VAE and text "
                          "encoder", file=file, key=key)
    return _of_kinds(data, model_type, folder, encoders, kinds, file, key)


def _single_file(data: dict, file, prefix: str) -> None:
    """diffusion-pipe's ``single_file_path`` (LTX-Video's): the transformer and VAE in one file, ComfyUI's checkpoint
    layout, so it is our diffusion_model read as a combined checkpoint (its VAE from the same file)."""
    key = _key(prefix, SINGLE_FILE_KEY)
    model_type = data.get("type")
    if model_type not in folder_types(SINGLE_FILE_KEY):
        raise ConfigError(f"a single-file release is read for model types {', '.join(folder_types(SINGLE_FILE_KEY))} "
                          f"only (as in diffusion-pipe); for {model_type!r} {HINT}", file=file, key=key)
    value = data.pop(SINGLE_FILE_KEY)
    if not isinstance(value, str):
        raise ConfigError(f"got {value!r}; give the file's path as a string", file=file, key=key)
    _fill(data, {"diffusion_model": value})


def _lent_text_encoders(data: dict, model_type: str, folder: Path, encoders: list[str], file, key: str) -> list[str]:
    """The text-encoder folders of a ``dp_single_file`` type's own Diffusers folder, whose transformer and VAE
    ComfyUI does not read: those come from single_file_path."""
    from ..models.registry import arch_spec
    if not data.get("diffusion_model"):
        example = arch_spec(model_type).example_file
        raise ConfigError(f"ComfyUI does not read this folder's transformer and VAE: add single_file_path = "
                          f"'<{example}>' (the single-file release, ComfyUI's models/checkpoints); the folder gives "
                          "the text encoder", file=file, key=key)
    kinds = arch_spec(model_type).text_encoders
    return _of_kinds(data, model_type, folder, encoders, kinds, file, key)


def _of_kinds(data: dict, model_type: str, folder: Path, encoders: list[str], kinds, file, key: str) -> list[str]:
    """The folder's text-encoder folders of ``kinds`` (told by each one's config.json)."""
    from .model_folders import read_config, text_encoder_kind
    taken = [sub for sub in encoders if text_encoder_kind(read_config(folder / sub)) in kinds]
    if not taken and not data.get("text_encoders"):
        raise ConfigError(f"{folder}: no {' or '.join(kinds)} text encoder folder (told by its config.json) for "
                          f"{model_type}; add t5_path = '<t5xxl_fp16.safetensors>' (ComfyUI's models/text_encoders)",
                          file=file, key=key)
    return taken


def _checkpoint_folder(data: dict, file, prefix: str) -> None:
    model_type = data.get("type")
    if model_type not in folder_types("ckpt_path"):
        raise ConfigError(f"PipeTrain reads an official checkpoint folder for Wan only; for {model_type!r} {HINT}",
                          file=file, key=_key(prefix, "ckpt_path"))
    value, folder = _folder(data, "ckpt_path", file, prefix)
    if not data.get("text_encoders"):
        raise ConfigError(f"the folder's T5 (.pth, the original code's layout) is not read by ComfyUI; add "
                          f"{TEXT_ENCODER_HINT}", file=file, key=_key(prefix, "ckpt_path"))
    vae = next((name for name in WAN_VAES if (folder / name).is_file()), None)
    if vae is None and not data.get("vae"):
        raise ConfigError(f"{folder}: no {' or '.join(WAN_VAES)} in this folder; add vae_path = "
                          "'<wan_2.1_vae.safetensors>' (ComfyUI's models/vae)", file=file,
                          key=_key(prefix, "ckpt_path"))
    _fill(data, {"diffusion_model": value, "vae": str(Path(value) / vae) if vae else None})
