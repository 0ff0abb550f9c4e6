"""Epoch LoRAs: gathered from every pipeline stage to global rank 0 and written once, atomically,
under a name that never repeats, with the adapter config and the run config beside it."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import lora
from ..fsutil import atomic_write_bytes
from . import distributed


def gather_lora(module, dp_rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every stage's adapters (from its data-parallel rank 0), merged on all ranks."""
    local = lora.state_dict(module, dtype) if dp_rank == 0 else {}
    merged = {}
    for part in distributed.all_gather_object(local):
        merged.update(part)
    return merged


def unique_path(folder: Path, stem: str) -> Path:
    path = folder / f"{stem}.safetensors"
    n = 1
    while path.exists():
        path = folder / f"{stem}-{n}.safetensors"
        n += 1
    return path


def write_lora(sd, folder: Path, stem: str, adapter_config: dict, run_toml: str, info: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = unique_path(folder, stem)
    lora.save_file(sd, path, lora.metadata_for(adapter_config, info))
    base = path.with_suffix("")
    atomic_write_bytes(Path(f"{base}.adapter.json"), json.dumps(adapter_config, indent=1).encode())
    atomic_write_bytes(Path(f"{base}.run.toml"), run_toml.encode())
    return path
