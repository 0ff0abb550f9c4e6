# SPDX-License-Identifier: GPL-3.0-or-later
"""``check-config``'s read of the model files a config names: each file's or folder's safetensors header (bounded,
no weight read, nothing unpickled), told the way the loaders tell it (``models/loading.py``, ``te_loading.py``):
the diffusion model's type by ComfyUI's detection, each text encoder's kind, the VAE's decoder channels.

A missing path, a header that is no safetensors header, a folder of another model (a Flux pipeline folder given as
SD3), a text-encoder folder ComfyUI reads no weights from, or text encoders of other kinds than the model type's are
findings with an error, each under the key the user wrote (``transformer_path``, ``diffusers_path``, ...), so the
run fails here rather than after its cache."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import compat
from ..errors import ModelError, PipeTrainError
from ..config.model_folders import SAFETENSORS_SUFFIXES

PICKLED_NOTE = ("not read: a pickled file, which check-config never unpickles (the run loads it with torch's "
                "weights-only loader)")
# the [model] keys that name a role's files, in the order a table's keys win (diffusion-pipe's single-file keys
# over a folder's parts, ``compat_folders``)
ROLE_KEYS = {"diffusion_model": ("diffusion_model", "transformer_path"), "vae": ("vae", "vae_path"),
             "clip_vision": ("clip_vision",), "merge_adapters": ("merge_adapters",)}


@dataclass(frozen=True)
class Finding:
    key: str            # the key the user wrote that names the file (``model.diffusers_path``, ...)
    path: Path
    found: str          # what its header says
    error: str | None = None

    def line(self) -> str:
        if self.error is not None:
            return f"  {self.key}: ERROR: {self.error}"
        return f"  {self.key}: {self.path}: {self.found}"


def source_key(raw_model: dict, role: str, index: int = 0) -> str:
    """The key of ``[model]`` as written that names a role's file: its own key, else diffusion-pipe's spelling,
    else the folder key whose part it is."""
    single = compat.model_folders.SINGLE_FILE_KEY   # gives the transformer and VAE, never the text encoders
    order = [k for k in compat.FOLDER_KEYS if k != single] if role == "text_encoders" else [single, *compat.FOLDER_KEYS]
    folder = next((k for k in order if k in raw_model), None)
    if role == "text_encoders":
        if "text_encoders" in raw_model:
            return f"model.text_encoders[{index}]"
        given = [k for k in compat.TEXT_ENCODER_KEYS if k in raw_model]
        return f"model.{given[index] if index < len(given) else folder or 'text_encoders'}"
    own = next((k for k in ROLE_KEYS[role] if k in raw_model), None)
    if role == "merge_adapters" and own is None:   # diffusion-pipe's [adapter] fuse_adapters (compat.py)
        return f"adapter.fuse_adapters[{index}]"
    suffix = f"[{index}]" if role == "merge_adapters" else ""
    return f"model.{own or folder or role}{suffix}"


def check_model_files(cfg, raw_model: dict) -> list[Finding]:
    """One finding per model file or folder ``cfg`` names (the roles a combined checkpoint gives are read by
    ``preflight.check_checkpoint_parts``), then one for the text encoders together."""
    from ..host.runtime import ensure_comfyui

    ensure_comfyui()   # ComfyUI's detection tells the model type, as it does when the run loads the file
    model, from_checkpoint = cfg.model, cfg.model.from_checkpoint()
    found = [_diffusion_model(cfg.resolve(model.diffusion_model), model.type,
                              source_key(raw_model, "diffusion_model"))]
    if "vae" not in from_checkpoint:
        found.append(_vae(cfg.resolve(model.vae), model.type, source_key(raw_model, "vae")))
    if "text_encoders" not in from_checkpoint:
        found += _text_encoders([cfg.resolve(p) for p in model.text_encoder_files], model.type, raw_model)
    if model.clip_vision:
        found.append(_readable(cfg.resolve(model.clip_vision), source_key(raw_model, "clip_vision"), "CLIP-vision"))
    for i, (lora, _) in enumerate(model.merged_loras):
        found.append(_readable(cfg.resolve(lora), source_key(raw_model, "merge_adapters", i), "LoRA"))
    return found


def _header(path: Path):
    """(shapes, metadata) of a file or folder; None for a pickled file (not read). ModelError: missing, unreadable,
    not safetensors."""
    from ..models.loading import read_header

    if not (path.is_file() or path.is_dir()):
        raise ModelError(f"{path}: {'not a regular file or folder' if path.exists() else 'file or folder not found'}")
    if path.is_file() and path.suffix.lower() not in SAFETENSORS_SUFFIXES:
        return None
    return read_header(path)


def _read(path: Path, key: str) -> tuple[tuple | None, Finding | None]:
    """(the header, None), or (None, the finding that ends this file's check: an error, or a pickled file noted
    unread)."""
    try:
        header = _header(path)
    except PipeTrainError as exc:
        return None, Finding(key, path, "", str(exc))
    return header, (Finding(key, path, PICKLED_NOTE) if header is None else None)


def _kind_of_path(path: Path) -> str:
    return "folder" if path.is_dir() else "file"


def _diffusion_model(path: Path, model_type: str, key: str) -> Finding:
    from ..models.loading import check_architecture
    from ..models.registry import arch_spec

    ended = _read(path, key)[1]
    if ended is not None:
        return ended
    try:
        arch = check_architecture(path, model_type)
    except PipeTrainError as exc:
        return Finding(key, path, "", str(exc))
    return Finding(key, path, f"a {arch_spec(arch).title} diffusion model {_kind_of_path(path)} (model type "
                              f"{arch!r})")


def _vae(path: Path, model_type: str, key: str) -> Finding:
    from ..models.registry import arch_spec
    from ..models import vaes
    from ..models.vaes import decoder_channels

    header, ended = _read(path, key)
    if ended is not None:
        return ended
    kind = vaes.kind(arch_spec(model_type).vae)
    channels = decoder_channels(header[0])
    if channels is None:
        return Finding(key, path, f"a VAE {_kind_of_path(path)} ({len(header[0])} tensors; its header does not tell "
                                  "its latent channels)")
    if channels != kind.decoder_channels:
        return Finding(key, path, "", f"{path}: this VAE decodes {channels}-channel latents; {model_type} needs a "
                                      f"{kind.title}, which decodes {kind.decoder_channels}: pick that VAE file")
    return Finding(key, path, f"a VAE {_kind_of_path(path)} decoding {channels}-channel latents, as the "
                              f"{kind.title} does")


def _text_encoders(paths: list[Path], model_type: str, raw_model: dict) -> list[Finding]:
    """Each file readable, then their kinds together against the model type's (ComfyUI loads them as one)."""
    from ..models.te_loading import _te_title, check_text_encoder_kinds

    keys = [source_key(raw_model, "text_encoders", i) for i in range(len(paths))]
    found = []
    for key, path in zip(keys, paths):
        ended = _read(path, key)[1]
        if ended is not None:
            found.append(ended)
    if found:
        return found
    try:
        kinds = check_text_encoder_kinds(paths, model_type)
    except PipeTrainError as exc:
        named = [k for k, p in zip(keys, paths) if str(p) in str(exc)]   # one file at fault, or the set
        key = named[0] if len(named) == 1 else ", ".join(dict.fromkeys(keys))
        return [Finding(key, paths[0], "", str(exc))]
    return [Finding(key, path, f"a {_te_title(kind)} text encoder {_kind_of_path(path)}")
            for key, path, kind in zip(keys, paths, kinds)]


def _readable(path: Path, key: str, what: str) -> Finding:
    header, ended = _read(path, key)
    if ended is not None:
        return ended
    return Finding(key, path, f"a {what} {_kind_of_path(path)} ({len(header[0])} tensors)")
