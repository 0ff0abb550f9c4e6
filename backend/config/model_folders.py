# SPDX-License-Identifier: GPL-3.0-or-later
"""Model folders (diffusion-pipe's ``diffusers_path``, ``checkpoint_path`` and ``ckpt_path``): which files of a
folder hold its weights, and the components of a Diffusers pipeline folder.

A component folder (``transformer/``, ``unet/``, ``vae/``, ``text_encoder*/`` of a Diffusers pipeline, or an
official checkpoint folder such as Wan's) is read as the union of its safetensors shards: the files its
``*.safetensors.index.json`` names, else every ``.safetensors`` file without a variant suffix
(``model.fp16.safetensors`` is a second copy of ``model.safetensors``). The loaders (``models/loading.py``) give
that state dict to ComfyUI's own loaders, which convert the Diffusers / Hugging Face keys. A safetensors file's
header (its tensors' names and shapes, and its metadata) is read here too, bounded and without the weights.
Nothing here imports torch or ComfyUI: the config checks use it too.
"""
from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path

from ..errors import ModelError

INDEX_SUFFIX = ".safetensors.index.json"
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
MAX_HEADER = 100_000_000   # the safetensors library's own limit on a header's length


def safetensors_header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """A safetensors file's tensor shapes (name -> shape) and metadata, from its header alone: the 8-byte length,
    then that much JSON. Only a regular file is opened for reading (a FIFO or a device would block or never end),
    and a length over ``MAX_HEADER`` or past the file's end is refused before it is read. ModelError names the
    file; no message quotes its bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ModelError(f"{path}: model file not found") from None
    except OSError as exc:
        raise ModelError(f"{path}: cannot open this model file ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ModelError(f"{path}: not a regular file; name a .safetensors model file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= length <= min(MAX_HEADER, info.st_size - 8):
                raise ModelError(f"{path}: not a safetensors file (no header of a valid length); name a "
                                 ".safetensors model file")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise ModelError(f"{path}: cannot read this model file ({exc.strerror})") from None
    except (ValueError, UnicodeDecodeError):
        raise ModelError(f"{path}: not a safetensors file (its header is not JSON); name a .safetensors model "
                         "file") from None
    finally:
        os.close(fd)
    return _shapes(path, header)


def _shapes(path: Path, header) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    if not isinstance(header, dict):
        raise ModelError(f"{path}: not a safetensors file (its header is no table of tensors)")
    metadata = header.pop("__metadata__", None) or {}
    shapes = {}
    for name, entry in sorted(header.items()):   # in name order, as the safetensors library lists them
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise ModelError(f"{path}: not a safetensors file (a tensor without a shape in its header)")
        shapes[name] = tuple(shape)
    if not isinstance(metadata, dict):
        raise ModelError(f"{path}: not a safetensors file (its metadata is no table)")
    return shapes, {str(k): str(v) for k, v in metadata.items()}


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


OTHER_TEXT_ENCODER_FOLDERS = ("mllm",)   # OmniGen2's pipeline names its Qwen2.5-VL folder after its role


def pipeline_components(folder: Path) -> dict[str, object]:
    """A Diffusers pipeline folder's component folders (relative names): ``diffusion_model``
    (``transformer`` or ``unet``), ``vae`` and ``text_encoders`` (``text_encoder``, ``text_encoder_2``, ... in
    that order, then ``OTHER_TEXT_ENCODER_FOLDERS``). Raises ValueError naming what is missing."""
    folder = Path(folder)
    if not (folder / "model_index.json").is_file():
        raise ValueError(f"{folder} is not a Diffusers pipeline folder (it has no model_index.json)")
    unet = next((name for name in DIFFUSION_MODEL_FOLDERS if (folder / name).is_dir()), None)
    if unet is None or not (folder / "vae").is_dir():
        raise ValueError(f"{folder}: a Diffusers pipeline folder needs a transformer/ (or unet/) and a vae/ folder")
    encoders = sorted((p.name for p in folder.glob("text_encoder*") if p.is_dir()),
                      key=lambda n: int(n.rpartition("_")[2]) if n[-1].isdigit() else 1)
    encoders += [name for name in OTHER_TEXT_ENCODER_FOLDERS if (folder / name).is_dir()]
    return {"diffusion_model": unet, "vae": "vae", "text_encoders": encoders}


# Hugging Face text-encoder configs -> the text-encoder kind (``models/encoders.py``) ComfyUI loads their keys as:
# CLIP, T5 and Llama, whose Hugging Face keys are ComfyUI's own (its CLIP, T5 and Llama modules use the same names;
# a Llama folder's lm_head is left out, ``llm_state_dict``), and Qwen2.5-VL (Qwen-Image's), whose keys
# ``qwen_vl_state_dict`` renames. Other encoders (Gemma, ...) are read from their single files only.
CLIP_WIDTHS = {768: "clip_l", 1024: "clip_h", 1280: "clip_g"}
T5_TYPES = {"t5": "t5xxl", "umt5": "umt5xxl"}
QWEN_VL_TYPES = ("qwen2_5_vl",)
LLAMA_TYPES = ("llama",)   # Llama 3 / 3.1 8B (HiDream's llama3_path; HunyuanVideo's LLaVA-Llama-3 text model)
QWEN_VL_3B_WIDTH = 2048   # Qwen2.5-VL-3B's language model (OmniGen2's); every other width reads as the 7B's kind


def text_encoder_kind(config: dict) -> str | None:
    """The kind of a text-encoder folder from its ``config.json``; None where ComfyUI reads no such folder."""
    model_type = config.get("model_type", "")
    if model_type in ("clip_text_model", "clip"):
        return CLIP_WIDTHS.get(config.get("hidden_size", (config.get("text_config") or {}).get("hidden_size")))
    if model_type in LLAMA_TYPES:
        return "llama"
    if model_type in QWEN_VL_TYPES:
        return "qwen25_3b" if text_config(config).get("hidden_size") == QWEN_VL_3B_WIDTH else "qwen25_7b"
    if model_type == "t5" and not str(config.get("feed_forward_proj", "")).startswith("gated"):
        return None   # T5 v1.0 (ReLU): Cosmos' encoder, only from ComfyUI's single file
    return T5_TYPES.get(model_type)


# --- Diffusers' Wan 2.1 / Qwen-Image VAE (AutoencoderKLQwenImage) -> the original Wan VAE keys ComfyUI loads ---
# The two name the same modules differently: diffusers nests each decoder stage as up_blocks.i.resnets.j and
# .upsamplers.0 where the original keeps one flat list (upsamples.n: per stage num_res_blocks + 1 residual blocks,
# then the stage's resampler, the last stage has none); its encoder list (down_blocks.n) is flat in both. A
# residual block's layers are the original's Sequential positions: RMS norm 0, SiLU 1, conv 2, norm 3, SiLU 4,
# dropout 5, conv 6; its 1x1 shortcut is "shortcut". The middle is [resnet, attention, resnet] in the original.
WAN_VAE_CLASSES = ("AutoencoderKLQwenImage",)
_RESNET_PARTS = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6",
                 "conv_shortcut": "shortcut"}
_WAN_VAE_TOP = {"quant_conv": "conv1", "post_quant_conv": "conv2", "conv_in": "conv1", "conv_out": "head.2",
                "norm_out": "head.0"}


def is_wan_vae_folder(config: dict) -> bool:
    """Whether a ``vae/`` folder's config is diffusers' Wan-architecture VAE (Qwen-Image's)."""
    return config.get("_class_name") in WAN_VAE_CLASSES


def _resnet_part(rest: str) -> str:
    first, _, tail = rest.partition(".")
    return f"{_RESNET_PARTS.get(first, first)}.{tail}"


def wan_vae_key(key: str, resnets_per_stage: int) -> str:
    """One diffusers Wan VAE key in the original Wan VAE's naming (``resnets_per_stage``: num_res_blocks + 1)."""
    parts = key.split(".")
    if parts[0] in ("quant_conv", "post_quant_conv"):
        return ".".join([_WAN_VAE_TOP[parts[0]], *parts[1:]])
    coder, name, rest = parts[0], parts[1], ".".join(parts[2:])
    if name in ("conv_in", "conv_out", "norm_out"):
        return f"{coder}.{_WAN_VAE_TOP[name]}.{rest}"
    if name == "mid_block":   # mid_block.resnets.0 / attentions.0 / resnets.1 -> middle.0 / 1 / 2
        kind, index, tail = rest.split(".", 2)
        if kind == "attentions":
            return f"{coder}.middle.1.{tail}"
        return f"{coder}.middle.{2 * int(index)}.{_resnet_part(tail)}"
    if name == "down_blocks":
        index, tail = rest.split(".", 1)
        return f"{coder}.downsamples.{index}.{_resnet_part(tail)}"
    if name == "up_blocks":
        stage, kind, index, tail = rest.split(".", 3)
        position = int(stage) * (resnets_per_stage + 1)
        if kind == "upsamplers":
            return f"{coder}.upsamples.{position + resnets_per_stage}.{tail}"
        return f"{coder}.upsamples.{position + int(index)}.{_resnet_part(tail)}"
    raise ValueError(f"not a diffusers Wan VAE key: {key!r}")


def wan_vae_state_dict(sd: dict) -> dict:
    """A diffusers Wan VAE state dict in the original Wan VAE's naming (ComfyUI's ``comfy.ldm.wan.vae``)."""
    resnets = 1 + max((int(k.split(".")[4]) for k in sd if k.startswith("decoder.up_blocks.0.resnets.")),
                      default=2)
    return {wan_vae_key(k, resnets): v for k, v in sd.items()}


def text_config(config: dict) -> dict:
    """A Hugging Face config's language-model numbers: transformers 4.5x+ nest a VL model's under ``text_config``
    (earlier ones keep them at the top level)."""
    return {**config, **(config.get("text_config") or {})}


# --- Hugging Face Qwen2.5-VL -> ComfyUI's Qwen25_7BVLI ----------------------------------------------------------
# ComfyUI names the language model model.* and the vision tower visual.*, as transformers < 4.52 saved them;
# later transformers save model.language_model.* and model.visual.*. The module names below those prefixes are
# the same in both (ComfyUI's vision blocks, merger and Llama layers use Hugging Face's names). lm_head (the
# vocabulary projection) is never run for an embedding, and ComfyUI's module has none.
QWEN_VL_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def qwen_vl_state_dict(sd: dict) -> dict:
    """A Hugging Face Qwen2.5-VL state dict (either layout) in ComfyUI's key names, without lm_head."""
    def renamed(key: str) -> str:
        for old, new in QWEN_VL_PREFIXES:
            if key.startswith(old):
                return new + key[len(old):]
        return key
    return {renamed(k): v for k, v in llm_state_dict(sd).items()}


def llm_state_dict(sd: dict) -> dict:
    """A Hugging Face causal language model's state dict without lm_head: a text encoder never runs the vocabulary
    projection, and ComfyUI's LLM modules have none (a Llama folder's other keys are ComfyUI's as they are)."""
    return {k: v for k, v in sd.items() if not k.startswith("lm_head.")}
