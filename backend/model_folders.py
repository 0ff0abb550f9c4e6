# SPDX-License-Identifier: GPL-3.0-or-later
"""Model folders (diffusion-pipe's ``diffusers_path``, ``checkpoint_path`` and ``ckpt_path``): which files of a
folder hold its weights, and the components of a Diffusers pipeline folder.

A component folder (``transformer/``, ``unet/``, ``vae/``, ``text_encoder*/`` of a Diffusers pipeline, or an
official checkpoint folder such as Wan's) is read as the union of its safetensors shards: the files its
``*.safetensors.index.json`` names, else every ``.safetensors`` file without a variant suffix
(``model.fp16.safetensors`` is a second copy of ``model.safetensors``). The loaders (``models/loading.py``) give
that state dict to ComfyUI's own loaders, which convert the Diffusers / Hugging Face keys. Nothing here imports
torch or ComfyUI: the config checks use it too.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import ModelError

INDEX_SUFFIX = ".safetensors.index.json"


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files that together hold ``folder``'s weights (ModelError when there are none)."""
    folder = Path(folder)
    indexes = sorted(folder.glob("*" + INDEX_SUFFIX))
    if indexes:
        try:
            names = sorted(set(json.loads(indexes[0].read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise ModelError(f"{indexes[0]}: cannot read this shard index ({exc})") from exc
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelError(f"{folder}: shard '{missing[0]}' named by {indexes[0].name} is missing "
                             f"({len(missing)} of {len(names)} missing)")
        return [folder / n for n in names]
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    plain = [p for p in files if "." not in p.stem]   # model.fp16.safetensors: a variant copy of model.safetensors
    if plain or files:
        return plain or files
    other = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    hint = (f"; it holds {', '.join(other[:3])}: PipeTrain reads safetensors only (convert them, or use ComfyUI's "
            "single .safetensors file)") if other else ""
    raise ModelError(f"{folder}: no .safetensors weights in this folder{hint}")


def fingerprint_files(folder: Path) -> list[Path]:
    """Every file under ``folder`` whose bytes decide what loads from it: the weight shards and the JSON configs
    (a text encoder's ``config.json`` sizes it)."""
    folder = Path(folder)
    return sorted({*weight_files(folder), *(p for p in folder.glob("*.json") if p.is_file())})


def read_config(folder: Path) -> dict:
    """The component's ``config.json`` ({} when it has none)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: cannot read this config ({exc})") from exc


# --- Diffusers pipeline folders ------------------------------------------------------------------
DIFFUSION_MODEL_FOLDERS = ("transformer", "unet")


def pipeline_components(folder: Path) -> dict[str, object]:
    """A Diffusers pipeline folder's component folders (relative names): ``diffusion_model``
    (``transformer`` or ``unet``), ``vae`` and ``text_encoders`` (``text_encoder``, ``text_encoder_2``, ... in
    that order). Raises ValueError naming what is missing."""
    folder = Path(folder)
    if not (folder / "model_index.json").is_file():
        raise ValueError(f"{folder} is not a Diffusers pipeline folder (it has no model_index.json)")
    unet = next((name for name in DIFFUSION_MODEL_FOLDERS if (folder / name).is_dir()), None)
    if unet is None or not (folder / "vae").is_dir():
        raise ValueError(f"{folder}: a Diffusers pipeline folder needs a transformer/ (or unet/) and a vae/ folder")
    encoders = sorted((p.name for p in folder.glob("text_encoder*") if p.is_dir()),
                      key=lambda n: int(n.rpartition("_")[2]) if n[-1].isdigit() else 1)
    return {"diffusion_model": unet, "vae": "vae", "text_encoders": encoders}


# Hugging Face text-encoder configs -> the text-encoder kind (``models/encoders.py``) ComfyUI loads their keys as:
# CLIP and T5, whose Hugging Face keys are ComfyUI's own (its CLIP and T5 modules use the same names). Other
# encoders (Qwen2.5-VL, Llama, Gemma, ...) keep keys ComfyUI does not read from a folder: their single files.
CLIP_WIDTHS = {768: "clip_l", 1024: "clip_h", 1280: "clip_g"}
T5_TYPES = {"t5": "t5xxl", "umt5": "umt5xxl"}


def text_encoder_kind(config: dict) -> str | None:
    """The kind of a text-encoder folder from its ``config.json``; None where ComfyUI reads no such folder."""
    model_type = config.get("model_type", "")
    if model_type in ("clip_text_model", "clip"):
        return CLIP_WIDTHS.get(config.get("hidden_size", (config.get("text_config") or {}).get("hidden_size")))
    if model_type == "t5" and not str(config.get("feed_forward_proj", "")).startswith("gated"):
        return None   # T5 v1.0 (ReLU): Cosmos' encoder, only from ComfyUI's single file
    return T5_TYPES.get(model_type)
