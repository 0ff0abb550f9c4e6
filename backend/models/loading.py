# SPDX-License-Identifier: GPL-3.0-or-later
"""Load diffusion models, text encoders and VAEs with ComfyUI's own code.

Real files go through ComfyUI's loaders and detection unchanged, and so do PipeTrain's tiny files (``tiny.py``)
wherever ComfyUI can read them: a tiny diffusion model whose config its weights do not tell carries the config in
its safetensors metadata, and ComfyUI's own ``load_diffusion_model`` loads it with its detection given that config
(``patches_comfyui.detection_from_config``); tiny text encoders go through ComfyUI's text-encoder loading with their
configs as its model options and their kinds given (``patches_comfyui.text_encoder_kinds``: ComfyUI tells kinds, and
which encoder of a pair a file is, by layers only full-depth files have); a tiny VAE goes through ``comfy.sd.VAE``
like a real one, narrowed where ComfyUI fixes the width. Only tiny CLIP-vision files are still built from ComfyUI's
class with the config from their metadata (ComfyUI picks a CLIP-vision config file by layer keys). Every result is the object ComfyUI returns (``ModelPatcher``, ``comfy.sd.CLIP``), so
callers never tell the two apart. Every failure is a ``ModelError`` naming the file. Nothing here names an
architecture: each one's facts are its adapter's ``spec`` (``spec.py``) and the kinds of ``encoders.py`` / ``vaes.py``.
"""
from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path

import torch

from ..errors import ModelError
from ..config.model_folders import (SAFETENSORS_SUFFIXES, is_wan_vae_folder, read_config, safetensors_header,
    wan_vae_state_dict, weight_files)
from ..host.patches_comfyui import detection_from_config, narrowed_class
from ..host.runtime import ensure_comfyui
from .registry import ADAPTERS, arch_spec, arch_specs
from . import vaes

SUPPORTED_ARCHS = tuple(ADAPTERS)
META_ARCH, META_UNET, META_TE_KIND, META_TE = (
    "pipetrain.arch", "pipetrain.unet_config", "pipetrain.te_kind", "pipetrain.te_config")
META_VAE_KIND, META_VAE = "pipetrain.vae_kind", "pipetrain.vae_config"   # tiny VAEs ComfyUI cannot size


# --- reading files -------------------------------------------------------------------------------
def _require_file(path) -> Path:
    """A model file, or a model folder (``model_folders``: its safetensors shards are the file)."""
    path = Path(path)
    if not (path.is_file() or path.is_dir()):
        raise ModelError(f"{path}: model file not found")
    return path


def _merged_shards(folder: Path, read) -> tuple[dict, dict]:
    """``read`` (a file -> (key -> value, metadata)) over a model folder's shards, merged; the first's metadata."""
    merged, metadata = {}, None
    for shard in weight_files(folder):
        more, meta = read(shard)
        merged.update(more)
        metadata = meta if metadata is None else metadata
    return merged, metadata or {}


def read_header(path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """The file's tensor shapes (key -> shape) and metadata, reading no tensor data for safetensors; a folder's
    are its shards' together (the metadata of the first)."""
    path = _require_file(path)
    if path.is_dir():
        return _merged_shards(path, read_header)
    try:
        if path.suffix.lower() in SAFETENSORS_SUFFIXES:
            return safetensors_header(path)
        ensure_comfyui()
        import comfy.utils
        sd = comfy.utils.load_torch_file(str(path), safe_load=True)
        return {k: tuple(v.shape) for k, v in sd.items() if hasattr(v, "shape")}, {}
    except ModelError:
        raise
    except pickle.UnpicklingError:
        raise _pickled(path) from None
    except Exception as exc:  # safetensors/torch raise many types for a corrupt file
        raise ModelError(f"{path}: cannot read this model file ({exc})") from exc


def _pickled(path: Path) -> ModelError:
    """torch's restricted unpickler met more than tensors and plain values: its message quotes the file's globals
    and suggests loading it unrestricted, which would run them."""
    return ModelError(f"{path}: holds more than tensors and plain values (loading it could run code), so it is not "
                      "loaded; use a .safetensors file of these weights")


def _load_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    ensure_comfyui()
    import comfy.utils
    if path.is_dir():   # a model folder: its shards' tensors in one state dict
        return _merged_shards(path, _load_state_dict)
    try:
        sd, metadata = comfy.utils.load_torch_file(str(path), safe_load=True, return_metadata=True)
    except pickle.UnpicklingError:
        raise _pickled(path) from None
    except Exception as exc:
        raise ModelError(f"{path}: cannot read this model file ({exc})") from exc
    return sd, metadata or {}


def _meta_state_dict(shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    return {k: torch.empty(s, device="meta") for k, s in shapes.items()}


def folder_meta_state_dict(path) -> dict[str, torch.Tensor]:
    """A model file's or folder's tensors on the meta device (from the headers: no weights read)."""
    return _meta_state_dict(read_header(path)[0])


# --- diffusion models ----------------------------------------------------------------------------
def _arch_of_config(config_cls: type, unet_config: dict) -> str | None:
    """The model type of a ComfyUI config class; where several share it, their specs' ``accepts`` decide."""
    import comfy.supported_models as sm
    for arch, spec in arch_specs().items():
        if any(getattr(sm, name) is config_cls for name in spec.comfy_configs) and (
                spec.accepts is None or spec.accepts(unet_config)):
            return arch
    return None


def comfy_layout(sd: dict, metadata: dict | None = None) -> tuple[dict | None, dict]:
    """ComfyUI's unet_config for a diffusion model's state dict and the state dict in ComfyUI's layout, told and
    converted the way ``comfy.sd.load_diffusion_model_state_dict`` does it: ComfyUI's own keys as they are, else its
    Diffusers MMDiT conversions (Flux, SD3, AuraFlow, PixArt), else its Diffusers UNet one (SD1.x/SDXL). Works on
    meta tensors (shapes only). (None, sd) when ComfyUI tells no model from it."""
    import comfy.model_detection as md
    import comfy.utils
    prefix = md.unet_prefix_from_state_dict(sd)   # a whole checkpoint's diffusion model, or a bare one
    sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)} or sd
    try:
        unet_config = md.detect_unet_config(sd, "", metadata=metadata)
    except Exception:  # other architectures' branches may need real values, or keys a Diffusers file lacks
        unet_config = None
    if unet_config is not None:
        return unet_config, sd
    converted = md.convert_diffusers_mmdit(dict(sd), "")
    if converted:
        try:
            return md.detect_unet_config(converted, ""), converted
        except Exception:
            return None, sd
    config = md.model_config_from_diffusers_unet(sd)
    if config is None:
        return None, sd
    keys = comfy.utils.unet_to_diffusers(config.unet_config)
    return config.unet_config, {keys[k]: v for k, v in sd.items() if k in keys}


def arch_from_state_dict_shapes(shapes: dict[str, tuple]) -> str | None:
    """ComfyUI's own detection run on key shapes only (no weights): a model type PipeTrain trains, or None."""
    ensure_comfyui()
    import comfy.supported_models as sm
    unet_config, sd = comfy_layout(_meta_state_dict(shapes))
    if unet_config is None:
        return None
    for config_cls in sm.models:  # first match wins, as in comfy.model_detection
        if config_cls.matches(unet_config, sd):
            return _arch_of_config(config_cls, unet_config)
    return None


def detect_architecture(path) -> str | None:
    """The model type of a diffusion-model file (ComfyUI's detection or PipeTrain's metadata), else None."""
    return _arch_of(*read_header(path))


def check_architecture(path, model_type: str) -> str:
    """Before anything is cached or loaded: the diffusion-model file is of a kind ``model_type`` trains (the
    header alone tells; types that share ComfyUI's model class, like Flux and Flux Kontext, share files). Returns
    the model type the file is."""
    path = _require_file(path)
    shapes, metadata = read_header(path)
    found = _arch_of(shapes, metadata)
    if found is None:
        raise _undetected(path, shapes)
    if found != model_type and not set(arch_spec(found).comfy_configs) & set(arch_spec(model_type).comfy_configs):
        raise ModelError(f"{path}: model.type = {model_type!r}, but this file is a {arch_spec(found).title} "
                         f"diffusion model; set model.type = {found!r} or pick a {arch_spec(model_type).title} file")
    return found


def _arch_of(shapes: dict, metadata: dict) -> str | None:
    if META_UNET in metadata:
        arch = metadata.get(META_ARCH)
        return arch if arch in SUPPORTED_ARCHS else None
    return arch_from_state_dict_shapes(shapes)


def _undetected(path: Path, shapes: dict) -> ModelError:
    first = next(iter(shapes), "no tensors")
    specs = arch_specs().values()
    titles = ", ".join(s.title for s in specs)
    examples = ", ".join(s.example_file for s in specs if s.example_file)
    return ModelError(
        f"{path}: ComfyUI does not recognise this file as a diffusion model PipeTrain trains ({titles}; "
        f"expected the diffusion-model weights, e.g. {examples}; found {len(shapes)} tensors, first '{first}'). "
        "Pick the diffusion model file, not a LoRA, VAE or text encoder.")


def load_diffusion_model(path, dtype: torch.dtype | None, *, arch: str | None = None):
    """A ``comfy.model_patcher.ModelPatcher`` for a diffusion model of a supported type (real or tiny), loaded by
    ComfyUI's ``comfy.sd.load_diffusion_model``; a file that names its config in its metadata (a tiny one) has
    ComfyUI's detection give that config (``patches_comfyui.detection_from_config``).

    ``arch``, when given, is what the caller expects; another architecture raises ``ModelError``.
    """
    path = _require_file(path)
    shapes, metadata = read_header(path)
    found = _arch_of(shapes, metadata)
    if found is None:
        raise _undetected(path, shapes)
    if arch is not None and found != arch:
        raise ModelError(f"{path}: expected a {arch} diffusion model, but this file is {found}")
    ensure_comfyui()
    import comfy.sd
    options = {} if dtype is None else {"dtype": dtype}
    if path.is_dir():   # ComfyUI's loader for a state dict converts Diffusers keys (``comfy_layout``)
        sd = _load_state_dict(path)[0]
        load = lambda: comfy.sd.load_diffusion_model_state_dict(sd, model_options=options)  # noqa: E731
    else:
        load = lambda: comfy.sd.load_diffusion_model(str(path), model_options=options)  # noqa: E731
    if META_UNET not in metadata:
        patcher = load()
        if patcher is None:
            raise _undetected(path, shapes)
        return patcher
    unet_config = json.loads(metadata[META_UNET])   # a tiny file, also as a folder's shard
    try:
        unet_config = arch_spec(found).host_config(unet_config)
        with detection_from_config(unet_config, model_config(found, unet_config)), \
                arch_spec(found).built_in(unet_config):
            patcher = load()
    except Exception as exc:
        raise ModelError(f"{path}: cannot build the {found} model from its '{META_UNET}' metadata ({exc})") from exc
    missing = sorted(k for k in set(patcher.model.diffusion_model.state_dict()) - _loaded_names(patcher, shapes)
                     if not k.endswith(SCALE_KEYS))
    if missing:   # ComfyUI only logs them
        raise ModelError(f"{path}: {len(missing)} weights of the {found} model in its metadata are missing, "
                         f"e.g. '{missing[0]}'; the file is incomplete or its metadata is wrong")
    return patcher


def _loaded_names(patcher, shapes: dict) -> set[str]:
    """The diffusion-model weight names a file's keys load into: ComfyUI renames some on load (0.33 loads Flux's
    ``*_norm.scale`` into ``*_norm.weight``, ``process_unet_state_dict``)."""
    sd = _meta_state_dict(_unprefixed(shapes))
    return set(patcher.model.model_config.process_unet_state_dict(sd))


def _unprefixed(shapes: dict) -> dict:
    """A whole checkpoint's diffusion-model keys without their prefix (ComfyUI's ``unet_prefix_from_state_dict``);
    a bare diffusion model's as they are."""
    import comfy.model_detection as md
    prefix = md.unet_prefix_from_state_dict(shapes)
    return {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)} or shapes


def model_config(arch: str, unet_config: dict):
    """ComfyUI's ``comfy.supported_models`` config for ``arch`` with this unet_config (ComfyUI's detection picks the
    same class from a real file's weights)."""
    import comfy.supported_models as sm
    unet_config = arch_spec(arch).host_config(unet_config)
    candidates = [getattr(sm, name) for name in arch_spec(arch).comfy_configs]
    config_cls = next((c for c in candidates if c.matches(unet_config)), candidates[0])
    config = config_cls(unet_config)
    # BASE.__init__ overwrites head settings with the published ones; the file's own values win.
    config.unet_config.update({k: unet_config[k] for k in config_cls.unet_extra_config if k in unet_config})
    return config


SCALE_KEYS = (".scale_weight", ".scale_input")   # scaled-fp8 linears default them to 1 when a file leaves them out


def build_model(arch: str, unet_config: dict, dtype: torch.dtype, device=None,
                manual_cast_dtype: torch.dtype | None = None):
    """ComfyUI's model (``model_base``: the diffusion model and its model_sampling) for ``arch`` built from a
    config in memory, its weights as ComfyUI's constructors leave them, in a ModelPatcher: what
    ``ModelAdapter.use_model`` takes where no file is loaded (benchmarks, tests). ``manual_cast_dtype``: weights
    stored in ``dtype`` (float8) compute in this one, as ComfyUI loads such a model."""
    ensure_comfyui()
    import comfy.model_management as mm
    import comfy.model_patcher
    config = model_config(arch, unet_config)
    config.set_inference_dtype(dtype, manual_cast_dtype)
    with arch_spec(arch).built_in(unet_config):
        model = config.get_model({}, "", device=device)
    if device is not None:
        model = model.to(device)   # some buffers are made on the CPU
    return comfy.model_patcher.ModelPatcher(model, load_device=device or mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


def build_meta_model(path, dtype: torch.dtype, arch: str, manual_cast_dtype: torch.dtype | None = None):
    """The model in ``path`` built on the ``meta`` device (shapes only, nothing read but the header): what the
    memory plan traces (``meta_trace.py``); ``manual_cast_dtype`` as ``build_model``'s."""
    path = _require_file(path)
    shapes, metadata = read_header(path)
    if META_UNET in metadata:
        return build_model(arch, json.loads(metadata[META_UNET]), dtype, "meta", manual_cast_dtype)
    ensure_comfyui()
    unet_config, _ = comfy_layout(_meta_state_dict(shapes), metadata)
    if unet_config is None:
        raise ModelError(f"{path}: ComfyUI cannot tell this file's model configuration from its weights; the "
                         "memory plan needs a file in ComfyUI's own layout")
    return build_model(arch, unet_config, dtype, "meta", manual_cast_dtype)


def merge_loras(patcher, loras: list[tuple[Path, float]]) -> None:
    """``[model] merge_adapters``: each LoRA (any format ComfyUI's LoRA loader reads) baked into the base
    weights at its strength, exactly as ComfyUI's ``LoraLoaderModelOnly`` patches them at that strength, before
    the training adapter goes on top (e.g. Z-Image Turbo's de-distillation adapter)."""
    import comfy.lora
    import comfy.utils

    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    sd = patcher.model.state_dict()
    for path, strength in loras:
        path = _require_file(path)
        try:
            lora = comfy.utils.load_torch_file(str(path), safe_load=True)
        except Exception as exc:
            raise ModelError(f"{path}: cannot read this LoRA ({exc})") from exc
        by_key: dict[str, list] = {}
        for k, patch in comfy.lora.load_lora(lora, key_map, log_missing=False).items():
            key, offset, function = (k, None, None) if isinstance(k, str) else (k[0], k[1], k[2] if len(k) > 2 else None)
            if key in sd:   # ModelPatcher.add_patches' tuple: (strength, patch, strength_model, offset, function)
                by_key.setdefault(key, []).append((strength, patch, 1.0, offset, function))
        if not by_key:
            raise ModelError(f"{path}: none of its keys fits this {type(patcher.model).__name__} model; "
                             "merge_adapters takes LoRAs made for the model being trained")
        with torch.no_grad():
            for key, patches in by_key.items():
                weight = sd[key]
                weight.copy_(comfy.lora.calculate_weight(patches, weight.float(), key).to(weight.dtype))


# --- CLIP vision ---------------------------------------------------------------------------------
META_CLIP_VISION = "pipetrain.clip_vision_config"


def load_clip_vision(path):
    """ComfyUI's ``ClipVisionModel`` for a CLIP-vision file: a real one through ComfyUI's own detection, a tiny
    one (``tiny.write_clip_vision``) built from the config in its metadata."""
    import os
    import tempfile

    path = _require_file(path)
    _, metadata = read_header(path)
    ensure_comfyui()
    import comfy.clip_vision
    if META_CLIP_VISION not in metadata:
        try:
            model = comfy.clip_vision.load(str(path))
        except Exception as exc:
            raise ModelError(f"{path}: ComfyUI could not load this CLIP-vision file ({exc})") from exc
        if model is None:
            raise ModelError(f"{path}: ComfyUI does not recognise this file as a CLIP-vision model "
                             "(expected e.g. clip_vision_h.safetensors from models/clip_vision)")
        return model
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:   # ComfyUI reads a JSON file
        f.write(metadata[META_CLIP_VISION])
    try:
        model = comfy.clip_vision.ClipVisionModel(f.name)
    finally:
        os.unlink(f.name)
    missing, _ = model.load_sd(_load_state_dict(path)[0])
    if missing:
        raise ModelError(f"{path}: {len(missing)} CLIP-vision weights are missing, e.g. '{missing[0]}'")
    return model


# --- VAE -----------------------------------------------------------------------------------------
def _narrowed_vae_class(metadata: dict):
    """A tiny file of a VAE whose width ComfyUI fixes (``VAEKind.widths``, e.g. Wan 2.2's) names its widths in
    its metadata: while ComfyUI's detection builds the VAE, its class takes them."""
    kind = vaes.kinds().get(metadata.get(META_VAE_KIND, ""))
    if META_VAE not in metadata or kind is None or not kind.narrowed_class:
        return contextlib.nullcontext()
    widths = json.loads(metadata[META_VAE])
    if "," not in kind.narrowed_class:
        return narrowed_class(kind.narrowed_class, widths)
    stack = contextlib.ExitStack()   # several classes narrowed: widths are keyed by each class's target
    for target in kind.narrowed_class.split(","):
        stack.enter_context(narrowed_class(target, widths[target]))
    return stack


def load_vae(path, *, arch: str | None = None):
    """A ``comfy.sd.VAE``; ``arch``, when given, checks the latent channels (its spec's VAE kind)."""
    path = _require_file(path)
    read_header(path)
    sd, metadata = _load_state_dict(path)
    if path.is_dir() and is_wan_vae_folder(read_config(path)):
        sd = wan_vae_state_dict(sd)   # ComfyUI reads only the original Wan VAE's key names
    import comfy.sd
    try:
        with _narrowed_vae_class(metadata):
            vae = comfy.sd.VAE(sd=sd, metadata=metadata)
    except Exception as exc:
        raise ModelError(f"{path}: ComfyUI could not build a VAE from this file ({exc})") from exc
    if vae.first_stage_model is None:
        raise ModelError(f"{path}: ComfyUI does not recognise this file as a VAE (expected e.g. the Flux "
                         f"ae.safetensors or the SDXL VAE)")
    if arch is not None:
        check_vae(vae, path, arch)
    return vae


def check_vae(vae, path, arch: str) -> None:
    """The VAE's latent channels and dimensions are those of ``arch``'s (its spec's VAE kind)."""
    kind = vaes.kind(arch_spec(arch).vae)
    if vae.latent_channels != kind.latent_channels:
        raise ModelError(f"{path}: a {arch} VAE ({kind.title}) has {kind.latent_channels} latent channels, "
                         f"this one has {vae.latent_channels}")
    if vae.latent_dim != kind.latent_dim:
        what = {2: "images", 3: "videos"}
        raise ModelError(f"{path}: a {arch} VAE ({kind.title}) encodes {what.get(kind.latent_dim)}, this one "
                         f"encodes {what.get(vae.latent_dim, 'something else')}")


# the text encoders' loading lives in te_loading.py (imported last: it reads this module's helpers)
from .te_loading import _real_te_kind, load_text_encoders  # noqa: E402,F401
