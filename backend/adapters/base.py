"""The adapter interface every ``[adapter] type`` implements, and the pieces its kinds share.

An adapter lives on an existing ``Linear`` (ComfyUI's ``comfy.ops`` classes included): its kind creates
trainable parameters there (``attach``), and one forward hook hands the layer's input and base output to the kind
(``forward``), so module paths and base weights stay untouched. ``saved`` / ``load`` name the tensors exactly as
ComfyUI's ``comfy/weight_adapter`` reads them under ``diffusion_model.<module path>.``.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    dtype: torch.dtype = torch.float32
    seed: int = 0
    kind: str = "lora"              # a key of ``adapters.ADAPTERS``
    decompose_factor: int = -1      # lokr: the Kronecker factor sizes (-1: as close to square as possible)
    dora: bool = False              # lora: weight-decomposed (DoRA), saved with ComfyUI's ``dora_scale``

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class AdapterKind:
    """One adapter type, stateless: the tensors live on the adapted linear."""
    name: str
    marker: str            # the saved part whose presence means "this module is in the file"

    def default_alpha(self, rank: int) -> float:
        """``alpha`` when the config leaves it out (diffusion-pipe: alpha = rank, a scale of 1)."""
        return float(rank)

    def attach(self, linear: nn.Module, spec: AdapterSpec, generator: torch.Generator) -> None:
        raise NotImplementedError

    def forward(self, linear: nn.Module, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """The adapted layer's output, from its input ``x`` (dropout not yet applied) and base ``output``."""
        raise NotImplementedError

    def parameters(self, linear: nn.Module) -> list[nn.Parameter]:
        raise NotImplementedError

    def saved(self, linear: nn.Module) -> dict[str, torch.Tensor]:
        """Saved part name (after ``<module key>.``) -> tensor."""
        raise NotImplementedError

    def load(self, linear: nn.Module, sd: dict[str, torch.Tensor], key: str) -> int:
        """Copy ``key``'s saved tensors in: 1 when found, 0 when ``sd`` has none; a shape mismatch raises."""
        raise NotImplementedError


class AddedModuleKind(AdapterKind):
    """A kind whose tensors are one child module of the linear, ``attribute`` = ``module(in_features,
    out_features, spec, generator, device)``, whose output on the (dropped-out) input is added to the base output,
    scaled by ``alpha / rank``; the module names its saved tensors (``saved_tensors(scale, alpha)``) and loads
    them (``load(sd, key, scale)``)."""
    attribute: str
    module: type[nn.Module]

    def attach(self, linear, spec, generator):
        child = self.module(linear.in_features, linear.out_features, spec, generator, linear.weight.device)
        setattr(linear, self.attribute, child)

    def forward(self, linear, x, output):
        return output + getattr(linear, self.attribute)(dropped(linear, x)) * linear.lora_scale

    def parameters(self, linear):
        return list(getattr(linear, self.attribute).parameters())

    def saved(self, linear):
        return getattr(linear, self.attribute).saved_tensors(linear.lora_scale, linear.lora_alpha)

    def load(self, linear, sd, key):
        return getattr(linear, self.attribute).load(sd, key, linear.lora_scale)


def generator_for(seed: int, name: str) -> torch.Generator:
    """Seeded per module, so the initial adapter is the same however the model is split across ranks."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def uniform_(weight: torch.Tensor, generator: torch.Generator) -> None:
    """What kaiming_uniform_(a=sqrt(5)) gives nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), seeded."""
    bound = 1 / math.sqrt(weight.shape[1])
    with torch.no_grad():
        init = torch.rand(weight.shape, generator=generator, dtype=torch.float64) * 2 - 1
        weight.copy_(init * bound)


def normal_(weight: torch.Tensor, generator: torch.Generator, std: float) -> None:
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=generator, dtype=torch.float64) * std)


def dropped(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The adapter's input: ``x`` through the ``[adapter] dropout`` while training."""
    if linear.lora_dropout is not None and linear.training:
        return linear.lora_dropout(x)
    return x


def copy_parts(module: nn.Module, names: tuple[str, ...], sd: dict[str, torch.Tensor], key: str,
               transform=None) -> None:
    """Copy ``sd[key.<name>]`` into ``module.<name>`` for each name, refusing a missing or misshapen tensor."""
    with torch.no_grad():
        for name in names:
            value = sd.get(f"{key}.{name}")
            param = getattr(module, name)
            if value is None or tuple(value.shape) != tuple(param.shape):
                got = "missing" if value is None else tuple(value.shape)
                raise ValueError(f"{key}.{name}: expected shape {tuple(param.shape)}, found {got} (another rank or "
                                 "adapter option?)")
            param.copy_(transform(name, value) if transform else value)
