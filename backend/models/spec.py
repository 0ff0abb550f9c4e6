# SPDX-License-Identifier: GPL-3.0-or-later
"""What an architecture is, as ``loading.py`` and ``tiny.py`` read it, so that neither names an architecture.

Each adapter class carries one ``ArchSpec`` (its ``spec`` attribute, defined beside the adapter): which
``comfy.supported_models`` classes ComfyUI's detection gives for it, its diffusion-model config per size
(``micro`` / ``tiny`` / ``full``) and the ComfyUI class built from one, its text-encoder kinds and VAE kind.
Text encoders and VAEs shared between architectures are the tables of ``encoders.py`` and ``vaes.py``; a kind
one model alone reads is declared in its own spec (``text_encoder_kinds``, ``vae_kinds``). ComfyUI's objects are named as ``module:name`` strings and resolved by ``comfy_object`` when used.
"""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

SIZES = ("micro", "tiny", "full")


@dataclass(frozen=True)
class ArchSpec:
    title: str                                   # for messages: "Flux", "SDXL", ...
    comfy_configs: tuple[str, ...]               # comfy.supported_models classes ComfyUI's detection gives
    unet_config: Callable[[str], dict]           # size -> ComfyUI's unet_config (the diffusion model's kwargs)
    build: Callable[[dict], torch.nn.Module]     # unet_config -> the ComfyUI network on the meta device
    detected_sizes: tuple[str, ...]              # sizes ComfyUI's detection recognises from the weights alone;
    #                                              the others carry their config in the file's metadata
    text_encoders: tuple[str, ...]               # text-encoder kinds (TEXT_ENCODERS), one file each
    clip_type: str                               # comfy.sd.CLIPType name ComfyUI loads its text encoders with
    vae: str                                     # VAE kind (VAES)
    example_file: str = ""                       # named in "not recognised" messages
    # where architectures share a ComfyUI class (Wan t2v and Wan 2.2 i2v are both WAN21_T2V): whether the
    # unet_config ComfyUI detected from a file is this one's
    accepts: Callable[[dict], bool] | None = None
    # its captions are read with an image (Qwen-Image-Edit): tiny text-encoder files keep what ``tiny_omits``
    # leaves out of the others (the VL model's vision tower)
    text_encoders_read_images: bool = False
    # the ``type`` names diffusion-pipe's ``[model] text_encoders`` tables may give (default: clip_type in lower case)
    text_encoder_types: tuple[str, ...] = ()
    # state-dict key -> init rule of diffusion-model files where the generic one would mislead ComfyUI's detection
    # (``tiny._make_tensor``'s rules; e.g. the bias SD 2.x's v-prediction detection reads)
    diffusion_model_init: dict[str, str] | None = None
    # unet_config -> the context ComfyUI's classes are built in (``loading.build_model``, ``load_diffusion_model``,
    # ``tiny``): where ComfyUI fixes a submodule's width that a tiny config narrows (ACE-Step's lyric encoder)
    building: Callable[[dict], contextlib.AbstractContextManager] | None = None
    # other text-encoder kind sets the model takes besides ``text_encoders`` (one per published size where sizes
    # read different encoders: Flux 2 Klein 9B reads Qwen3-8B, Klein 4B Qwen3-4B); tiny files use ``text_encoders``
    text_encoder_alternatives: tuple[tuple[str, ...], ...] = ()
    # the first ComfyUI release with this model's code where the ComfyUI class it shares is older (Flux 2 Klein
    # is ComfyUI's Flux2 class, which 0.3.75 has, with a text encoder only later releases load): "" where the
    # class itself tells (``parity.missing_comfy_code``)
    min_comfyui: str = ""
    # the text-encoder and VAE kinds this model brings that no other model reads, by kind name (``encoders.
    # TextEncoderKind``, ``vaes.VAEKind``), declared beside the adapter; shared kinds live in ``encoders.py`` and
    # ``vaes.py``. ``text_encoders`` and ``vae`` name either
    text_encoder_kinds: dict = field(default_factory=dict, hash=False, compare=False)
    vae_kinds: dict = field(default_factory=dict, hash=False, compare=False)

    def built_in(self, unet_config: dict) -> contextlib.AbstractContextManager:
        return self.building(unet_config) if self.building else contextlib.nullcontext()

    def host_config(self, unet_config: dict) -> dict:
        """``unet_config`` with whatever this ComfyUI's model class requires that it does not name, as this
        ComfyUI's own detection derives it from the model's key layout (``host_config``)."""
        return host_config(self, unet_config)

    def build_host(self, unet_config: dict) -> torch.nn.Module:
        """The network on the meta device for ``unet_config`` as this ComfyUI builds it."""
        config = self.host_config(unet_config)
        with self.built_in(config):
            return self.build(config)

    def accepted_text_encoder_types(self) -> tuple[str, ...]:
        return self.text_encoder_types or (self.clip_type.lower(),)

    def text_encoder_sets(self) -> tuple[tuple[str, ...], ...]:
        """Every set of text-encoder kinds the model takes, ``text_encoders`` first."""
        return (self.text_encoders, *self.text_encoder_alternatives)


_MISSING_ARGS = re.compile(r"missing \d+ required (?:positional|keyword-only) arguments?: (.+)$")
_completed: dict[tuple, dict] = {}


def _missing_arguments(error: TypeError) -> list[str]:
    """The argument names of Python's "missing N required ... argument(s): 'a', 'b' and 'c'" error, else []."""
    m = _MISSING_ARGS.search(str(error))
    return re.findall(r"'(\w+)'", m.group(1)) if m else []


def host_config(spec: ArchSpec, unet_config: dict) -> dict:
    """``unet_config`` completed with the fields the host ComfyUI's model class requires and it does not name.

    ComfyUI's releases add fields to its model parameters (``FluxParams.txt_ids_dims``, ``HunyuanVideoParams.
    meanflow_sum``, ...) and its detection derives them from a weights file's keys. So a config PipeTrain keeps
    (a size preset, a tiny file's metadata) is built once on the meta device with the missing fields empty, which
    gives the model's key layout, and the host's ``detect_unet_config`` on that layout supplies their values: the
    values it would give the user's own file of that layout. Where nothing is missing this costs one meta build,
    memoised per config."""
    key = (spec.title, json.dumps(unet_config, sort_keys=True, default=str))
    if key in _completed:
        return dict(_completed[key])
    probe, missing = dict(unet_config), []
    for _ in range(8):
        try:
            with spec.built_in(probe):
                model = spec.build(probe)
            break
        except TypeError as e:
            names = [n for n in _missing_arguments(e) if n not in probe]
            if not names:
                raise
            missing += names
            probe.update(dict.fromkeys(names))
    if not missing:
        _completed[key] = dict(unet_config)
        return dict(unet_config)
    detection = comfy_object("comfy.model_detection")
    detected = detection.detect_unet_config(model.state_dict(), "") or {}
    absent = [n for n in missing if n not in detected]
    if absent:
        from ..errors import ModelError
        raise ModelError(f"this ComfyUI's {spec.title} model needs {', '.join(absent)}, which its detection does not "
                         f"derive from the model's weights: PipeTrain cannot build it on this ComfyUI yet")
    done = {**unet_config, **{n: detected[n] for n in missing}}
    _completed[key] = done
    return dict(done)


def comfy_object(path: str):
    """The ComfyUI object named ``module:name`` (e.g. ``comfy.text_encoders.t5:T5``), or the module itself when no
    name follows. The file tables (``encoders.py``, ``vaes.py``) reach ComfyUI only through this, so ComfyUI is set
    up here (``ensure_comfyui``), as the registry sets it up before importing an architecture module."""
    import importlib

    from ..host.runtime import ensure_comfyui
    ensure_comfyui()
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name) if name else importlib.import_module(module)


def comfy_text_model(path: str):
    """``build`` for a ComfyUI text-model class taking (config, dtype, device, operations), e.g.
    ``comfy.text_encoders.t5:T5``."""
    def build(config: dict) -> torch.nn.Module:
        return comfy_object(path)(config, torch.float32, "meta", comfy_object("comfy.ops:disable_weight_init"))
    return build


def comfy_diffusion_model(path: str):
    """``ArchSpec.build`` for a ComfyUI diffusion-model class taking its unet_config as keyword arguments
    beside (device, operations), e.g. ``comfy.ldm.wan.model:WanModel``."""
    def build(config: dict) -> torch.nn.Module:
        return comfy_object(path)(device="meta", operations=comfy_object("comfy.ops:disable_weight_init"), **config)
    return build
