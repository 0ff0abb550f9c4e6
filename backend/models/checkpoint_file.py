# SPDX-License-Identifier: GPL-3.0-or-later
"""The VAE and text encoders of an all-in-one checkpoint: one file holding the diffusion model, the VAE and the text
encoders, as ComfyUI's CheckpointLoaderSimple loads it from models/checkpoints (an SD 1.x / SDXL checkpoint,
``ace_step_v1_3.5b.safetensors``, or what ComfyUI's own CheckpointSave writes).

Which keys are the VAE's and which the text encoders' is the model's ComfyUI config (``comfy.supported_models``:
``vae_key_prefix``, ``text_encoder_key_prefix``, ``clip_target``), so nothing here names an architecture. The parts
are built by ComfyUI's own ``comfy.sd.load_state_dict_guess_config`` -- the function CheckpointLoaderSimple runs --
asked for the VAE or the text encoders only: the diffusion model's tensors (ComfyUI's ``unet_prefix_from_state_dict``)
are handed to it on the ``meta`` device (its detection reads shapes alone), so a 3.5B checkpoint's VAE is read
without reading the diffusion model.

A tiny checkpoint (``tiny.write_checkpoint``) carries its parts' configs in its metadata as the separate tiny files
do: the diffusion model's (``pipetrain.unet_config``), the VAE's widths (``pipetrain.vae_kind`` / ``vae_config``) and
each text encoder's config by kind (``pipetrain.te_configs``), given to ComfyUI's loading here.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from ..errors import ModelError
from ..host.patches_comfyui import detection_from_config
from ..host.runtime import ensure_comfyui
from . import encoders
from .registry import arch_spec

META_TE_CONFIGS = "pipetrain.te_configs"   # a tiny checkpoint's text-encoder configs, {kind: config}


def _header(path, arch: str) -> tuple[dict, dict, object]:
    """(the file's tensor shapes, its metadata, ComfyUI's model config for its diffusion model); the file must be
    an ``arch`` model."""
    from .loading import META_UNET, _meta_state_dict, check_architecture, comfy_layout, model_config, read_header
    check_architecture(path, arch)
    shapes, metadata = read_header(path)
    ensure_comfyui()
    unet_config = (json.loads(metadata[META_UNET]) if META_UNET in metadata
                   else comfy_layout(_meta_state_dict(shapes), metadata)[0])
    return shapes, metadata, model_config(arch, unet_config)


def _parts(path: Path, arch: str, vae: bool) -> tuple[dict, dict, object]:
    """(state dict: the VAE's (``vae``) or the text encoders' tensors read, the rest on the meta device; the file's
    metadata; ComfyUI's model config for the file's diffusion model)."""
    import comfy.model_detection as md

    from .loading import _meta_state_dict
    shapes, metadata, config = _header(path, arch)
    # ComfyUI takes the VAE by its prefix; the text encoders' keys need not carry text_encoder_key_prefix (SDXL's
    # process_clip_state_dict reads conditioner.embedders.*): for them every key but the diffusion model's is read
    unet = md.unet_prefix_from_state_dict(shapes)
    read = {k for k in shapes if (k.startswith(tuple(config.vae_key_prefix)) if vae else not k.startswith(unet))}
    sd = _meta_state_dict({k: s for k, s in shapes.items() if k not in read})
    sd.update(_read(path, sorted(read)))
    return sd, metadata, config


def _read(path: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    if path.suffix.lower() not in (".safetensors", ".sft"):
        from .loading import _load_state_dict
        sd = _load_state_dict(path)[0]
        return {k: sd[k] for k in keys}
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in keys}
    except Exception as exc:  # safetensors raises many types for a corrupt file
        raise ModelError(f"{path}: cannot read this model file ({exc})") from exc


@contextlib.contextmanager
def comfy_reads_checkpoint(path, arch: str):
    """While inside, ComfyUI's checkpoint loading reads a tiny checkpoint as it reads a real one: its diffusion
    model's detection gives the config in the file's metadata (built as the architecture's spec builds a config
    narrower than ComfyUI allows, ``ArchSpec.building``), and the VAE classes ComfyUI fixes the widths of take
    the widths named there. A real file's loading is unchanged. Yields the file's metadata."""
    from .loading import META_UNET, _narrowed_vae_class, model_config, read_header
    from .te_loading import _patch_for
    metadata = read_header(path)[1]
    ensure_comfyui()
    _patch_for(list(arch_spec(arch).text_encoders))   # what ComfyUI needs before it builds their tokenizers
    with contextlib.ExitStack() as stack:
        if META_UNET in metadata:
            unet_config = json.loads(metadata[META_UNET])
            stack.enter_context(detection_from_config(unet_config, model_config(arch, unet_config)))
            stack.enter_context(arch_spec(arch).built_in(unet_config))
        stack.enter_context(_narrowed_vae_class(metadata))
        yield metadata


def text_encoder_options(metadata: dict, dtype: torch.dtype | None) -> dict:
    """ComfyUI's text-encoder model options for a checkpoint: a tiny one's configs (``pipetrain.te_configs``) as
    each kind's ``<name>_model_config`` option, and the dtype."""
    configs = json.loads(metadata.get(META_TE_CONFIGS, "{}"))
    options = {encoders.kind(kind).model_option or f"{encoders.kind(kind).comfy_name or kind}_model_config": config
               for kind, config in configs.items()}
    return options if dtype is None else {**options, "dtype": dtype}


def _load(path, arch: str, vae: bool, dtype: torch.dtype | None = None):
    """(the VAE or the CLIP ComfyUI builds from the checkpoint, or None; ComfyUI's model config of the file)."""
    import comfy.sd
    sd, metadata, config = _parts(Path(path), arch, vae)
    with comfy_reads_checkpoint(path, arch):
        try:
            _, clip, loaded_vae, _ = comfy.sd.load_state_dict_guess_config(
                sd, output_vae=vae, output_clip=not vae, output_model=False,
                te_model_options=text_encoder_options(metadata, dtype), metadata=metadata)
        except Exception as exc:
            part = "VAE" if vae else "text encoders"
            raise ModelError(f"{path}: ComfyUI could not read the {part} of this checkpoint ({exc})") from exc
    return (loaded_vae if vae else clip), config


def load_checkpoint_vae(path, arch: str):
    """The ``comfy.sd.VAE`` of an all-in-one checkpoint, as CheckpointLoaderSimple gives it."""
    from .loading import check_vae
    vae, config = _load(path, arch, vae=True)
    if vae is None or vae.first_stage_model is None:
        raise ModelError(f"{path}: this file holds no VAE (no '{config.vae_key_prefix[0]}*' weights ComfyUI reads); "
                         "name the VAE file in [model] vae (the Model node's vae)")
    check_vae(vae, path, arch)
    return vae


def load_checkpoint_text_encoders(path, arch: str, dtype: torch.dtype | None):
    """The ``comfy.sd.CLIP`` of an all-in-one checkpoint, as CheckpointLoaderSimple gives it."""
    clip, _ = _load(path, arch, vae=False, dtype=dtype)
    if clip is None:
        raise ModelError(f"{path}: this file holds no text encoders ComfyUI reads; name the text-encoder files in "
                         "[model] text_encoders (the Model node's text_encoder_1 ...)")
    return clip


def check_parts(path, arch: str, roles) -> None:
    """Before anything loads (the Model node, queue time): the file holds the parts ``roles`` ("vae",
    "text_encoders") are to be read from, told from its header by ComfyUI's own split of a checkpoint (the model
    config's VAE prefix and ``process_clip_state_dict``, run on shapes); ``ModelError`` naming the key to set."""
    import comfy.utils

    from .loading import _meta_state_dict
    shapes, _, config = _header(path, arch)
    sd = _meta_state_dict(shapes)
    if "vae" in roles and not comfy.utils.state_dict_prefix_replace(sd, {k: "" for k in config.vae_key_prefix},
                                                                       filter_keys=True):
        raise ModelError(f"{path}: this file holds no VAE (no '{config.vae_key_prefix[0]}*' weights), so the VAE "
                         "cannot come from it; name the VAE file in [model] vae (the Model node's vae)")
    if "text_encoders" in roles and not config.process_clip_state_dict(sd):
        raise ModelError(f"{path}: this file holds no text encoders ComfyUI reads, so they cannot come from it; "
                         "name their files in [model] text_encoders (the Model node's text_encoder_1 ...)")
