"""Adapters (``[adapter] type``: LoRA, LoKr, LoHa, OFT; DoRA as a LoRA option) on ComfyUI's linear layers,
saved in the key layouts ComfyUI loads unchanged: injection, the saved state and files. Each type is one module
of ``adapters`` implementing ``adapters.base.AdapterKind``; an adapted linear keeps its kind as
``adapter_kind``, plus ``lora_name`` (its path inside the diffusion model), ``lora_scale`` / ``lora_alpha`` and
``lora_dropout``, and one forward hook that hands its input and base output to the kind.
"""
from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from . import ADAPTERS
from .base import AdapterSpec, generator_for
from ..fsutil import fault_point, temp_path_beside

KEY_PREFIX = "diffusion_model."


def inject_configured(cfg, diffusion_model: nn.Module, block_prefixes) -> list[str]:
    """A run config's ``[adapter]`` injected into ``diffusion_model`` (its weights in ``[adapter] dtype``, float32
    by default); the adapted modules' names. What the trainer and the memory plan both put on the model."""
    from ..models.base import DTYPES

    a = cfg.adapter
    spec = spec_from_config(a, seed=cfg.seed, dtype=DTYPES[a.dtype] if a.dtype else torch.float32)
    return inject(diffusion_model, spec, block_prefixes, a.target_modules, a.exclude_modules)


def spec_from_config(adapter, seed: int = 0, dtype: torch.dtype | None = None) -> AdapterSpec:
    """The ``[adapter]`` table (``config.AdapterConfig``) as a spec."""
    alpha = adapter.alpha if adapter.alpha is not None else ADAPTERS[adapter.type].default_alpha(adapter.rank)
    return AdapterSpec(rank=adapter.rank, alpha=alpha, dropout=adapter.dropout, dtype=dtype or torch.float32,
                       seed=seed, kind=adapter.type, decompose_factor=adapter.decompose_factor, dora=adapter.dora)


# differential output preservation (train/preservation.py): while ``base_rows`` is on, the trailing share of every
# adapted layer's rows sees the adapter scaled to 0. A process-wide value, not a thread-local one: on a GPU the
# backward's recomputation of checkpointed blocks runs in autograd's own threads.
_base_parts = 0


@contextmanager
def base_rows(parts: int):
    """While on, the last ``1 / parts`` of the rows (the batch dimension, samples first, as the pipeline layers
    carry them) of every adapted layer's input get the layer's base output alone, exactly: the adapter is applied
    to the other rows only, so the base rows neither see it nor send it gradients."""
    global _base_parts
    previous, _base_parts = _base_parts, parts
    try:
        yield
    finally:
        _base_parts = previous


def _forward_hook(module, args, output):
    x = args[0]
    if not _base_parts:
        return module.adapter_kind.forward(module, x, output)
    rows = output.shape[0]
    if rows % _base_parts:
        raise RuntimeError(f"{module.lora_name}: {rows} rows, not {_base_parts} equal parts; differential output "
                           "preservation needs the samples on the first dimension of every adapted layer's input")
    adapted = rows - rows // _base_parts
    return torch.cat([module.adapter_kind.forward(module, x[:adapted], output[:adapted]), output[adapted:]])


def attach(linear: nn.Linear, name: str, spec: AdapterSpec) -> None:
    """Give ``linear`` a trainable adapter of ``spec.kind``; ``name`` is its path inside ComfyUI's diffusion model."""
    linear.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else None
    linear.lora_scale = spec.scale
    linear.lora_alpha = spec.alpha
    linear.lora_name = name
    linear.adapter_kind = ADAPTERS[spec.kind]
    linear.adapter_kind.attach(linear, spec, generator_for(spec.seed, name))
    linear.register_forward_hook(_forward_hook)


def inject(model: nn.Module, spec: AdapterSpec, block_prefixes: tuple[str, ...],
           patterns: list[str] | None = None, exclude: str | list[str] | None = None) -> list[str]:
    """Attach an adapter to every ``nn.Linear`` under ``block_prefixes`` (optionally filtered by regex
    ``patterns`` on the module path), except those ``exclude`` names (``excluded``). Freezes everything else.
    Returns the adapted module paths."""
    model.requires_grad_(False)
    regexes = [re.compile(p) for p in patterns or []]
    adapted = [name for name, m in model.named_modules() if hasattr(m, "adapter_kind")]
    names = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or hasattr(module, "lora_name"):
            continue
        if any(name.startswith(a + ".") for a in adapted):   # an adapter's own layers (lora_A, lora_B)
            continue
        if not any(name == p or name.startswith(p + ".") for p in block_prefixes):
            continue
        if (regexes and not any(r.search(name) for r in regexes)) or excluded(name, exclude):
            continue
        attach(module, name, spec)
        adapted.append(name)
        names.append(name)
    if not names:
        raise ValueError(f"no linear layer matched the LoRA targets {block_prefixes} / {patterns}")
    return names


def excluded(name: str, exclude: str | list[str] | None) -> bool:
    """diffusion-pipe's ``exclude_modules`` (PEFT's rule): a string is a regex the whole module path must match;
    a list names modules by their whole path or its trailing dotted parts (``img_attn.qkv`` excludes
    ``double_blocks.0.img_attn.qkv``, ``attn.qkv`` does not)."""
    if exclude is None:
        return False
    if isinstance(exclude, str):
        return re.fullmatch(exclude, name) is not None
    return any(name == key or name.endswith("." + key) for key in exclude)


def adapted_modules(model: nn.Module):
    for module in model.modules():
        if hasattr(module, "adapter_kind"):
            yield module


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in adapted_modules(model) for p in m.adapter_kind.parameters(m)]


def state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """ComfyUI-keyed adapter tensors of every adapter in ``model`` (on the CPU)."""
    out = {}
    for m in adapted_modules(model):
        key = KEY_PREFIX + m.lora_name
        for part, w in m.adapter_kind.saved(m).items():
            w = w.detach().to("cpu")
            out[f"{key}.{part}"] = w.to(dtype) if dtype is not None and part != "alpha" else w.clone()
    return out


def load_into(model: nn.Module, sd: dict[str, torch.Tensor]) -> int:
    """Copy saved adapter tensors into the matching adapters of ``model``; returns how many modules matched."""
    return sum(m.adapter_kind.load(m, sd, KEY_PREFIX + m.lora_name) for m in adapted_modules(model))


def save_file(sd: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write a LoRA atomically (a temporary name, then rename) with string metadata."""
    from safetensors.torch import save_file as st_save

    tmp = temp_path_beside(path)
    try:
        st_save({k: v.contiguous() for k, v in sd.items()}, str(tmp), metadata=metadata)
        fault_point("lora-written")
        tmp.replace(path)
        fault_point("lora-renamed")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from ..errors import ConfigError

    if not Path(path).is_file():
        raise ConfigError(f"LoRA file not found: {path}", key="adapter.init_from_existing")
    return load_file(str(path))


def metadata_for(adapter_config: dict, extra: dict | None = None) -> dict[str, str]:
    meta = {"pipetrain.adapter_config": json.dumps(adapter_config, sort_keys=True), "format": "pt"}
    for k, v in (extra or {}).items():
        meta[f"pipetrain.{k}"] = v if isinstance(v, str) else json.dumps(v)
    return meta
