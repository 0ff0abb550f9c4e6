# SPDX-License-Identifier: GPL-3.0-or-later
"""Text encoders as ComfyUI loads them (``comfy.sd.load_clip`` and its detection of each file's kind), for real
files, PipeTrain's tiny ones (their config in the file's metadata) and diffusion-pipe's text-encoder folders.
Split from ``loading.py``, which re-exports ``load_text_encoders``."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import ModelError
from ..config.model_folders import llm_state_dict, qwen_vl_state_dict, read_config, text_config, text_encoder_kind
from ..host.patches_comfyui import text_encoder_kinds
from ..host.runtime import ensure_comfyui
from . import encoders
from .encoders import UMT5_MARKER
from .loading import (META_TE, META_TE_KIND, SUPPORTED_ARCHS, _load_state_dict, _meta_state_dict,
                      _require_file, read_header)
from .registry import ADAPTERS, arch_spec


def _real_te_kind(shapes: dict) -> str:
    import comfy.sd
    kind = comfy.sd.detect_te_model(_meta_state_dict(shapes))
    if kind is None:
        return "unknown"
    if kind.name == "T5_XXL" and UMT5_MARKER in shapes:
        return "umt5xxl"
    return next((k for k, spec in encoders.kinds().items() if kind.name in (spec.te_model, *spec.also_detected_as)),
                kind.name.lower())


def _te_title(kind: str) -> str:
    return encoders.kinds()[kind].title if kind in encoders.kinds() else kind


def _check_kinds(paths: list[Path], kinds: list[str], arch: str) -> None:
    sets = arch_spec(arch).text_encoder_sets()
    if not any(sorted(kinds) == sorted(want) for want in sets):
        got = ", ".join(f"{p.name}: {_te_title(k)}" for p, k in zip(paths, kinds))
        need = " or ".join(" + ".join(_te_title(k) for k in want) for want in sets)
        raise ModelError(f"{arch} needs the text encoders {need}, one file each; got {got or 'no files'}")


def _check_vision_towers(paths: list[Path], headers, kinds: list[str], arch: str) -> None:
    """A model that reads images with its captions needs each VL encoder's vision tower in the file (ComfyUI
    would build a missing one with uninitialised weights and only log the missing keys)."""
    if not arch_spec(arch).text_encoders_read_images:
        return
    for path, (shapes, _), kind in zip(paths, headers, kinds):
        for name in encoders.kind(kind).tiny_omits:
            if not any(k.startswith(f"{name}.") or f".{name}." in k for k in shapes):
                raise ModelError(f"{path}: this {_te_title(kind)} file has no vision tower ('{name}.*' weights); "
                                 f"{arch_spec(arch).title} reads each caption together with its control image: "
                                 "use the full file, e.g. ComfyUI's qwen_2.5_vl_7b_fp8_scaled.safetensors")


def _patch_for(kinds: list[str]) -> None:
    """What ComfyUI needs patched before it builds these kinds' tokenizers (``TextEncoderKind.comfy_patch``)."""
    for patch in {encoders.kind(kind).comfy_patch for kind in kinds} - {None}:
        patch()


def check_text_encoder_kinds(paths: list[Path], arch: str) -> list[str]:
    """The kind of each of ``arch``'s text-encoder files or folders, told from their headers (a folder's from its
    config.json) as the loader tells them, and checked against the kinds ``arch`` needs (ModelError naming the
    file): what ``check-config`` reports without loading a weight."""
    paths, headers, given = _told(paths, arch)
    kinds = [kind for kind, _ in given]
    _check_kinds(paths, kinds, arch)
    if not any(p.is_dir() for p in paths) and not any(META_TE in meta for _, meta in headers):
        _check_vision_towers(paths, headers, kinds, arch)
    return kinds


def _told(paths: list[Path], arch: str) -> tuple[list[Path], list, list[tuple[str, dict | None]]]:
    """(paths, their headers, (kind, config) of each): a folder's and a tiny file's config comes with it, a real
    file's is ComfyUI's own (None)."""
    if arch not in ADAPTERS:
        raise ModelError(f"unknown architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    paths = [_require_file(p) for p in paths]
    headers = [read_header(p) for p in paths]
    tiny = [META_TE in meta for p, (_, meta) in zip(paths, headers) if not p.is_dir()]
    if any(tiny) and not all(tiny):
        names = ", ".join(p.name for p, (_, meta) in zip(paths, headers) if META_TE in meta)
        raise ModelError(f"{names}: PipeTrain's tiny text encoders cannot be mixed with real ones")
    ensure_comfyui()
    return paths, headers, [_given_kind(p, shapes, meta, arch) for p, (shapes, meta) in zip(paths, headers)]


def load_text_encoders(paths: list[Path], arch: str, dtype: torch.dtype | None):
    """A ``comfy.sd.CLIP`` for ``arch`` from its text-encoder files (real or tiny) or Hugging Face folders."""
    paths, headers, given = _told(paths, arch)
    folders = any(p.is_dir() for p in paths)
    if folders or (paths and all(META_TE in meta for _, meta in headers)):
        return _load_given_text_encoders(paths, given, arch, dtype, whole=folders)
    kinds = [kind for kind, _ in given]
    _check_kinds(paths, kinds, arch)
    _check_vision_towers(paths, headers, kinds, arch)
    _patch_for(kinds)
    import comfy.sd
    clip_type = getattr(comfy.sd.CLIPType, arch_spec(arch).clip_type)
    options = {} if dtype is None else {"dtype": dtype}
    try:
        return comfy.sd.load_clip([str(p) for p in paths], clip_type=clip_type, model_options=options)
    except Exception as exc:
        raise ModelError(f"{', '.join(map(str, paths))}: ComfyUI could not load these text encoders ({exc})") from exc


def _given_kind(path: Path, shapes: dict, metadata: dict, arch: str) -> tuple[str, dict | None]:
    """(kind, config) of one text encoder: a Hugging Face folder's from its config.json (CLIP, T5, Llama and
    Qwen2.5-VL, whose keys ComfyUI reads), a tiny file's from its metadata, a real file's kind from ComfyUI's
    detection (and its config ComfyUI's own)."""
    if path.is_dir():
        config = read_config(path)
        kind = text_encoder_kind(config)
        if kind is None:
            need = " + ".join(_te_title(k) for k in arch_spec(arch).text_encoders)
            raise ModelError(
                f"{path}: ComfyUI reads no {config.get('model_type') or 'unknown'} text encoder from a Hugging Face "
                f"folder (only CLIP, T5, Llama and Qwen2.5-VL); give {arch}'s text encoders ({need}) as ComfyUI's "
                "single files (models/text_encoders) in text_encoders, or diffusion-pipe's llm_path / "
                "text_encoder_path")
        return kind, _sized_config(kind, config)
    if META_TE in metadata:
        return metadata.get(META_TE_KIND, "unknown"), json.loads(metadata[META_TE])
    return _real_te_kind(shapes), None


# Hugging Face's CLIPTextModel (CLIP-L in Flux, SD3 and SDXL folders) has no text projection; ComfyUI's CLIP-L
# module has one, which these models never read (they take CLIP-L's pooled output unprojected)
FOLDER_OPTIONAL = {"clip_l": ("text_projection.weight",)}
CLIP_KINDS = ("clip_l", "clip_g", "clip_h")
QWEN_VL_KINDS = ("qwen25_7b", "qwen25_3b")


def _folder_keys(kind: str, sd: dict) -> dict:
    """A Hugging Face folder's keys as ComfyUI's CLIP reads them: transformers 5 saves a CLIPTextModel without
    its ``text_model.`` prefix (earlier versions, and the published folders, keep it)."""
    if kind in CLIP_KINDS and not any(k.startswith("text_model.") for k in sd):
        return {k if k.startswith("text_projection") else f"text_model.{k}": v for k, v in sd.items()}
    if kind in QWEN_VL_KINDS:
        return qwen_vl_state_dict(sd)
    if kind == "llama":
        return llm_state_dict(sd)
    return sd


def _sized_config(kind: str, hf_config: dict) -> dict:
    """ComfyUI's config for ``kind`` with a folder's sizes (its numbers: widths, depths, vocabulary); the names
    stay ComfyUI's (Hugging Face names T5's tanh GELU ``gelu_new``, ComfyUI ``gelu_pytorch_tanh``)."""
    from .tiny import text_encoder_config
    config = text_encoder_config(kind, "full")
    return {**config, **{k: v for k, v in text_config(hf_config).items()
                         if k in config and isinstance(v, (int, float)) and not isinstance(v, bool)}}


def _load_given_text_encoders(paths: list[Path], given: list[tuple[str, dict | None]], arch: str, dtype, *,
                              whole: bool = False):
    """ComfyUI's own text-encoder loading (``load_text_encoder_state_dicts``, what ``load_clip`` runs on a real
    file's tensors) with each kind given (``patches_comfyui.text_encoder_kinds``: ComfyUI tells kinds apart by
    layers only full-depth files have) and each config that came with a file (a tiny file's metadata, a folder's
    config.json) as its ``<kind>_model_config`` option. ``whole``: no part of any encoder may be left out (a
    folder's encoder is the whole model)."""
    import comfy.sd
    kinds = [kind for kind, _ in given]
    _check_kinds(paths, kinds, arch)
    _patch_for(kinds)
    options = {encoders.kind(kind).model_option or f"{encoders.kind(kind).comfy_name or kind}_model_config": config
               for kind, config in given if config is not None}
    if dtype is not None:
        options["dtype"] = dtype
    state_dicts = [_folder_keys(kind, _load_state_dict(path)[0]) if path.is_dir() else _load_state_dict(path)[0]
                   for path, kind in zip(paths, kinds)]
    kind_of = {id(sd): (encoders.kind(kind).te_model, encoders.kind(kind).comfy_name or kind)
               for kind, sd in zip(kinds, state_dicts)}
    loaded: dict[int, object] = {}
    clip_type = getattr(comfy.sd.CLIPType, arch_spec(arch).clip_type)
    try:
        with text_encoder_kinds(kind_of, loaded):
            clip = comfy.sd.load_text_encoder_state_dicts(state_dicts, clip_type=clip_type, model_options=options)
    except Exception as exc:
        raise ModelError(f"{', '.join(map(str, paths))}: ComfyUI could not load these text encoders ({exc})") from exc
    for path, kind, sd in zip(paths, kinds, state_dicts):
        missing = loaded[id(sd)][0]
        # then no part may be left out; a model that reads captions alone never runs a VL encoder's vision tower
        reads_images = arch_spec(arch).text_encoders_read_images or (whole and not encoders.kind(kind).tiny_omits)
        omitted = () if reads_images else tuple(name + "." for name in encoders.kind(kind).tiny_omits)
        missing = [k for k in missing if not k.startswith(omitted)] if omitted else missing
        if path.is_dir():
            missing = [k for k in missing if k not in FOLDER_OPTIONAL.get(kind, ())]
        if missing:
            raise ModelError(f"{path}: {len(missing)} {_te_title(kind)} weights are missing, "
                             f"e.g. '{missing[0]}'; the file is incomplete or its metadata is wrong")
    return clip
