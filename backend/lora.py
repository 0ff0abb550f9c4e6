"""LoRA and LoKr adapters on ComfyUI's linear layers, saved in the key layouts ComfyUI loads unchanged.

Adapters are attached as child modules of the existing ``Linear`` (ComfyUI's ``comfy.ops`` classes
included) plus a forward hook, so module paths and base weights stay untouched. LoRA: children ``lora_A`` /
``lora_B``, saved as ``diffusion_model.<module path>.lora_A.weight`` (+ ``.alpha``). LoKr (LyCORIS' Kronecker
product, as diffusion-pipe trains it through PEFT): a child ``lokr`` holding ``lokr_w1`` and ``lokr_w2`` (or its
factors ``lokr_w2_a`` / ``lokr_w2_b``), saved under those names, which ``comfy/weight_adapter/lokr.py`` reads.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .fsutil import temp_path_beside

KEY_PREFIX = "diffusion_model."


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    dtype: torch.dtype = torch.float32
    seed: int = 0
    kind: str = "lora"              # lora | lokr
    decompose_factor: int = -1      # lokr: the Kronecker factor sizes (-1: as close to square as possible)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def spec_from_config(adapter, seed: int = 0, dtype: torch.dtype | None = None) -> LoRASpec:
    """The ``[adapter]`` table (``config.AdapterConfig``) as a spec."""
    return LoRASpec(rank=adapter.rank, alpha=adapter.alpha if adapter.alpha is not None else float(adapter.rank),
                    dropout=adapter.dropout, dtype=dtype or torch.float32, seed=seed, kind=adapter.type,
                    decompose_factor=adapter.decompose_factor)


def _generator(spec: LoRASpec, name: str) -> torch.Generator:
    """Seeded per module, so the initial adapter is the same however the model is split across ranks."""
    digest = hashlib.sha256(f"{spec.seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _uniform_(weight: torch.Tensor, generator: torch.Generator) -> None:
    """What kaiming_uniform_(a=sqrt(5)) gives nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), seeded."""
    bound = 1 / math.sqrt(weight.shape[1])
    with torch.no_grad():
        init = torch.rand(weight.shape, generator=generator, dtype=torch.float64) * 2 - 1
        weight.copy_(init * bound)


def _lora_forward_hook(module, args, output):
    x = args[0]
    if module.lora_dropout is not None and module.training:
        x = module.lora_dropout(x)
    a = module.lora_A.weight.to(x.dtype)
    b = module.lora_B.weight.to(x.dtype)
    return output + nn.functional.linear(nn.functional.linear(x, a), b) * module.lora_scale


def attach(linear: nn.Linear, name: str, spec: LoRASpec) -> None:
    """Give ``linear`` a trainable low-rank update; ``name`` is its path inside ComfyUI's diffusion model."""
    linear.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else None
    linear.lora_scale = spec.scale
    linear.lora_alpha = spec.alpha
    linear.lora_name = name
    if spec.kind == "lokr":
        from .lokr import LoKr
        linear.lokr = LoKr(linear.in_features, linear.out_features, spec, _generator(spec, name),
                           linear.weight.device)
        linear.register_forward_hook(_lokr_forward_hook)
        return
    device = linear.weight.device
    linear.lora_A = nn.Linear(linear.in_features, spec.rank, bias=False, device=device, dtype=spec.dtype)
    linear.lora_B = nn.Linear(spec.rank, linear.out_features, bias=False, device=device, dtype=spec.dtype)
    _uniform_(linear.lora_A.weight, _generator(spec, name))
    nn.init.zeros_(linear.lora_B.weight)
    linear.register_forward_hook(_lora_forward_hook)


def _lokr_forward_hook(module, args, output):
    x = args[0]
    if module.lora_dropout is not None and module.training:
        x = module.lora_dropout(x)
    return output + module.lokr(x) * module.lora_scale


def inject(model: nn.Module, spec: LoRASpec, block_prefixes: tuple[str, ...],
           patterns: list[str] | None = None) -> list[str]:
    """Attach LoRA to every ``nn.Linear`` under ``block_prefixes`` (optionally filtered by regex ``patterns``
    on the module path). Freezes everything else. Returns the adapted module paths."""
    model.requires_grad_(False)
    regexes = [re.compile(p) for p in patterns or []]
    names = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or hasattr(module, "lora_name"):
            continue
        if name.split(".")[-1] in ("lora_A", "lora_B") or ".lokr" in name:
            continue
        if not any(name == p or name.startswith(p + ".") for p in block_prefixes):
            continue
        if regexes and not any(r.search(name) for r in regexes):
            continue
        attach(module, name, spec)
        names.append(name)
    if not names:
        raise ValueError(f"no linear layer matched the LoRA targets {block_prefixes} / {patterns}")
    return names


def adapted_modules(model: nn.Module):
    for module in model.modules():
        if hasattr(module, "lora_name") and (hasattr(module, "lora_A") or hasattr(module, "lokr")):
            yield module


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    params = []
    for m in adapted_modules(model):
        params += list(m.lokr.parameters()) if hasattr(m, "lokr") else [m.lora_A.weight, m.lora_B.weight]
    return params


def state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """ComfyUI-keyed adapter tensors of every adapter in ``model`` (on the CPU)."""
    out = {}
    for m in adapted_modules(model):
        key = KEY_PREFIX + m.lora_name
        if hasattr(m, "lokr"):
            parts = m.lokr.saved_tensors(m.lora_scale, m.lora_alpha)
        else:
            parts = {f"{p}.weight": getattr(m, p).weight for p in ("lora_A", "lora_B")}
            parts["alpha"] = torch.tensor(float(m.lora_alpha))
        for part, w in parts.items():
            w = w.detach().to("cpu")
            out[f"{key}.{part}"] = w.to(dtype) if dtype is not None and part != "alpha" else w.clone()
    return out


def load_into(model: nn.Module, sd: dict[str, torch.Tensor]) -> int:
    """Copy saved adapter tensors into the matching adapters of ``model``; returns how many modules matched."""
    matched = 0
    for m in adapted_modules(model):
        key = KEY_PREFIX + m.lora_name
        if hasattr(m, "lokr"):
            matched += m.lokr.load(sd, key, m.lora_scale)
        elif f"{key}.lora_A.weight" in sd:
            with torch.no_grad():
                m.lora_A.weight.copy_(sd[f"{key}.lora_A.weight"])
                m.lora_B.weight.copy_(sd[f"{key}.lora_B.weight"])
            matched += 1
    return matched


def save_file(sd: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write a LoRA atomically (a temporary name, then rename) with string metadata."""
    from safetensors.torch import save_file as st_save

    tmp = temp_path_beside(path)
    try:
        st_save({k: v.contiguous() for k, v in sd.items()}, str(tmp), metadata=metadata)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from .errors import ConfigError

    if not Path(path).is_file():
        raise ConfigError(f"LoRA file not found: {path}", key="adapter.init_from_existing")
    return load_file(str(path))


def metadata_for(adapter_config: dict, extra: dict | None = None) -> dict[str, str]:
    meta = {"pipetrain.adapter_config": json.dumps(adapter_config, sort_keys=True), "format": "pt"}
    for k, v in (extra or {}).items():
        meta[f"pipetrain.{k}"] = v if isinstance(v, str) else json.dumps(v)
    return meta
