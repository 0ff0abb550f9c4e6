"""``[model]`` and ``[adapter]``: which model files train, and the adapter trained on them.

Only checks that hold for every model live here; what a model type accepts (its timestep range, a CLIP-vision
file, its text encoders' types) is the architecture's own check (``models/base.py``), run by ``preflight``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from . import compat
from ..errors import ConfigError

Dtype = Literal["float32", "bfloat16", "float16"]
WeightDtype = Literal["float32", "bfloat16", "float16", "float8", "float8_e4m3fn", "float8_e5m2"]


def unet_types() -> list[str]:
    """The model types whose network is a UNet (``model.unet_lr``): their adapters' ``unet``."""
    from ..models.registry import types_with
    return types_with("unet")


def token_length_keys() -> dict[str, str]:
    """Model type -> the [model] key of diffusion-pipe's caption token length it reads (``dp_token_length_key``)."""
    from ..models.registry import dp_facts
    return dp_facts("dp_token_length_key")


@dataclass
class TextEncoderConfig:
    """diffusion-pipe's table form of a text encoder entry: {path = ...} or {paths = [...]}, with a type."""
    path: Optional[str] = None
    paths: Optional[list[str]] = None
    type: Optional[str] = None

    def validate(self, file):
        if (self.path is None) == (self.paths is None):
            raise ConfigError("give exactly one of path or paths", file=file, key="model.text_encoders")

    @property
    def files(self) -> list[str]:
        return [self.path] if self.path is not None else list(self.paths)


@dataclass
class MergeAdapterConfig:
    """A ``merge_adapters`` entry's table form: a LoRA file and the strength it is merged at (diffusion-pipe's
    ``fuse_adapters`` entries, ``{path, weight}``)."""
    path: str
    weight: float = 1.0

    def validate(self, file):
        if not math.isfinite(self.weight):
            raise ConfigError(f"got {self.weight}; a strength is a finite number (1.0: the LoRA as trained)",
                              file=file, key="model.merge_adapters")


@dataclass
class ModelConfig:
    type: str
    diffusion_model: str
    # None (left out): the VAE of the diffusion_model file, an all-in-one checkpoint (CheckpointLoaderSimple's)
    vae: Optional[str] = None
    # file paths, or diffusion-pipe's {path|paths, type} tables (text_encoder_files: the paths in order); none:
    # the text encoders of the diffusion_model file, an all-in-one checkpoint
    text_encoders: list[Union[str, TextEncoderConfig]] = field(default_factory=list)
    dtype: Dtype = "bfloat16"
    diffusion_model_dtype: Optional[WeightDtype] = None
    timestep_sample_method: Literal["logit_normal", "uniform"] = "logit_normal"
    sigmoid_scale: float = 1.0
    shift: Optional[float] = None
    flux_shift: bool = False
    guidance: float = 1.0
    v_pred: bool = False
    min_t: float = 0.0                  # flow models: training timesteps restricted to [min_t, max_t] (Wan 2.2
    max_t: float = 1.0                  # experts; diffusion-pipe reads it for Wan only)
    min_snr_gamma: Optional[float] = None     # SDXL: per-sample weight min(SNR, gamma) / SNR (diffusion-pipe's)
    debiased_estimation_loss: bool = False    # SDXL: per-sample weight 1 / sqrt(SNR) (diffusion-pipe's)
    clip_vision: Optional[str] = None   # Wan 2.1 i2v: the CLIP-vision file (clip_vision_h.safetensors)
    # wan_fun_control: WanFunControlToVideo's start_image = the clip's first frame (true, the default), or none
    # (false: the control alone conditions, as the node runs without a start image; stills can train then)
    control_start_image: Optional[bool] = None
    # LoRAs merged into the base weights before training: paths (strength 1) or {path, weight} tables
    merge_adapters: list[Union[str, MergeAdapterConfig]] = field(default_factory=list)
    unet_lr: Optional[float] = None     # UNet models: the UNet's learning rate, over [optimizer] lr (diffusion-pipe's)
    # diffusion-pipe's token lengths: a caption's tokens cut to this many and padded to it. AuraFlow's Pile-T5
    # (max_sequence_length, the end token kept; diffusion-pipe requires it: 256 for AuraFlow, 768 for Pony V7; left
    # out here, ComfyUI's: every token, padded to 256) and HiDream's Llama 3 (max_llama3_sequence_length, the start
    # token counted; left out, diffusion-pipe's 128, which ComfyUI pads to without cutting)
    max_sequence_length: Optional[int] = None
    max_llama3_sequence_length: Optional[int] = None

    UNSUPPORTED = compat.MODEL
    preprocess = classmethod(lambda cls, data, file, prefix: compat.preprocess_model(data, file, prefix))

    def validate(self, file):
        if not 0.0 <= self.min_t < self.max_t <= 1.0:
            raise ConfigError(f"got min_t = {self.min_t}, max_t = {self.max_t}; need 0 <= min_t < max_t <= 1 "
                              "(Wan 2.2 14B: high-noise expert min_t = 0.875, low-noise max_t = 0.875 for t2v, "
                              "0.9 for i2v)", file=file, key="model.min_t")
        if self.unet_lr is not None and (self.type not in unet_types() or not self.unet_lr > 0):
            raise ConfigError(f"the UNet's learning rate, above 0, for {', '.join(unet_types())} (diffusion-pipe reads "
                              "it for SDXL); set [optimizer] lr instead", file=file, key="model.unet_lr")
        for model_type, key in token_length_keys().items():
            value = getattr(self, key)
            if value is not None and (self.type != model_type or value < 2):
                raise ConfigError(f"{model_type}'s token count, 2 or more (diffusion-pipe reads the key for "
                                  f"{model_type} only); leave it out for type {self.type!r}", file=file,
                                  key=f"model.{key}")
        if self.min_snr_gamma is not None and not self.min_snr_gamma > 0:
            raise ConfigError(f"got {self.min_snr_gamma}; must be > 0 (5 is the usual value), or leave it out",
                              file=file, key="model.min_snr_gamma")

    @property
    def text_encoder_files(self) -> list[str]:
        """The text-encoder paths, diffusion-pipe's ``{path|paths, type}`` tables flattened in order."""
        return [p for te in self.text_encoders for p in ([te] if isinstance(te, str) else te.files)]

    def from_checkpoint(self) -> set[str]:
        """The roles ("vae", "text_encoders") read from the diffusion_model file, an all-in-one checkpoint, because
        no file is named for them."""
        return {role for role, given in (("vae", self.vae), ("text_encoders", self.text_encoder_files)) if not given}

    def declared_text_encoder_types(self) -> list[tuple[int, str]]:
        """(index, type) of each text-encoder table that names a ``type``."""
        return [(i, te.type) for i, te in enumerate(self.text_encoders)
                if not isinstance(te, str) and te.type is not None]

    def file_paths(self) -> list[tuple[str, str]]:
        """(key, path) of every model file."""
        return [("model.diffusion_model", self.diffusion_model)] + ([("model.vae", self.vae)] if self.vae else []) + [
            (f"model.text_encoders[{i}]", p) for i, p in enumerate(self.text_encoder_files)] + (
            [("model.clip_vision", self.clip_vision)] if self.clip_vision else []) + [
            (f"model.merge_adapters[{i}]", p) for i, (p, _) in enumerate(self.merged_loras)]

    @property
    def merged_loras(self) -> list[tuple[str, float]]:
        """(path, strength) of each ``merge_adapters`` entry, in order."""
        return [(m, 1.0) if isinstance(m, str) else (m.path, m.weight) for m in self.merge_adapters]


@dataclass
class AdapterConfig:
    """``[adapter]``: a LoRA, LoKr, LoHa or OFT on the model's linears (``backend/adapters``). No ``[adapter]``
    table means a full fine-tune."""
    type: Literal["lora", "lokr", "loha", "oft"] = "lora"
    rank: int = 16
    alpha: Optional[float] = None       # diffusion-pipe forbids it (alpha = rank); allowed here, default rank
                                        # (oft: the constraint on its rotation, default 0: none)
    dropout: float = 0.0
    dtype: Optional[Dtype] = None       # LoRA weight dtype; default float32 (diffusion-pipe: the model dtype)
    target_modules: Optional[list[str]] = None
    init_from_existing: Optional[str] = None   # a LoRA .safetensors, or a folder holding adapter_model.safetensors
    decompose_factor: int = -1          # lokr: Kronecker factor size (-1: as square as possible)
    dora: bool = False                  # lora: weight-decomposed (DoRA), saved with ComfyUI's dora_scale
    # modules left without an adapter (diffusion-pipe's, PEFT's rule): a regex the whole module path matches, or a
    # list of paths or their trailing dotted parts (lora.excluded)
    exclude_modules: Union[str, list[str], None] = None

    UNSUPPORTED = compat.ADAPTER
    preprocess = classmethod(lambda cls, data, file, prefix: compat.preprocess_adapter(data, file, prefix))

    def validate(self, file):
        if isinstance(self.exclude_modules, str):
            try:
                re.compile(self.exclude_modules)
            except re.error as e:
                raise ConfigError(f"not a regular expression ({e}); give a regex or a list of module names",
                                  file=file, key="adapter.exclude_modules") from None
        if self.rank < 1:
            raise ConfigError(f"got {self.rank}; must be 1 or more", file=file, key="adapter.rank")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"got {self.dropout}; must be in [0, 1)", file=file, key="adapter.dropout")
        if self.decompose_factor == 0 or self.decompose_factor < -1:
            raise ConfigError(f"got {self.decompose_factor}; give a factor of 1 or more, or -1", file=file,
                              key="adapter.decompose_factor")
        if self.decompose_factor != -1 and self.type != "lokr":
            raise ConfigError("a LoKr option: set type = 'lokr' or remove it", file=file,
                              key="adapter.decompose_factor")
        if self.dora and self.type != "lora":
            raise ConfigError(f"DoRA decomposes a LoRA; set type = 'lora' or dora = false (type is '{self.type}')",
                              file=file, key="adapter.dora")
        if self.type == "oft" and self.dropout:
            raise ConfigError("OFT rotates the layer's output and has no adapter input to drop; set dropout = 0",
                              file=file, key="adapter.dropout")
        if self.type == "oft" and self.alpha is not None and self.alpha < 0:
            raise ConfigError(f"got {self.alpha}; OFT's alpha is its constraint: 0 (none) or more", file=file,
                              key="adapter.alpha")

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank

