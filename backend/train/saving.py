"""Epoch LoRAs: gathered from every pipeline stage to global rank 0 and written once, atomically,
under a name that never repeats, with the adapter config and the run config beside it."""
from __future__ import annotations

import glob
import json
from pathlib import Path

import torch

from ..adapters import injection
from ..config import without_secrets
from ..fsutil import atomic_write_bytes, space_guard
from ..run.folder import RunDir
from . import distributed
from .events import RunReporter, with_entry
from .parts import Topology


def gather_lora(module, dp_rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every stage's adapters (from its data-parallel rank 0), merged on all ranks."""
    local = injection.state_dict(module, dtype) if dp_rank == 0 else {}
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


def weights_stem(run: str, epoch: int, step: int, at_step: bool, ema: bool = False) -> str:
    """``<run>-epoch0003`` or ``<run>-step00000120``; the moving average (``ema``) beside it as ``…-ema``."""
    stem = f"{run}-step{step:08d}" if at_step else f"{run}-epoch{epoch:04d}"
    return f"{stem}-ema" if ema else stem


def write_lora(sd, folder: Path, stem: str, adapter_config: dict, run_toml: str, info: dict,
               replace: bool = False) -> Path:
    """``replace``: write ``<stem>.safetensors`` over a file of that name (atomically) rather than beside it."""
    with space_guard(folder):   # the writes below remove their own temporary files
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{stem}.safetensors" if replace else unique_path(folder, stem)
        injection.save_file(sd, path, injection.metadata_for(adapter_config, info))
        base = path.with_suffix("")
        atomic_write_bytes(Path(f"{base}.adapter.json"), json.dumps(adapter_config, indent=1).encode())
        atomic_write_bytes(Path(f"{base}.run.toml"), run_toml.encode())
    return path


def sweep_run_dir(run_dir: RunDir, lora_folder: Path) -> None:
    """Temporary files a killed run left (``fsutil`` and ``injection.save_file`` write under ``.<name>.*.tmp``, a
    checkpoint under ``checkpoints/.partial-*``, a full fine-tune's stages under ``.parts-*``). Called by the
    run folder's one live writer; in a shared LoRA folder only this run's own names are touched."""
    import shutil

    from .checkpoint import sweep

    sweep(run_dir.checkpoints)
    for path in run_dir.path.glob(".parts-*"):
        shutil.rmtree(path, ignore_errors=True)
    own = [f".{run_dir.name}-epoch", f".{run_dir.name}-step"]
    for folder, prefixes in ((run_dir.path, ["."]), (run_dir.models, own), (lora_folder, own)):
        for prefix in prefixes if folder.is_dir() else ():
            for path in folder.glob(f"{glob.escape(prefix)}*.tmp"):
                path.unlink(missing_ok=True)


# --- full fine-tune (no [adapter] table) ------------------------------------------------------------
LOW_PRECISION = (torch.float8_e4m3fn, torch.float8_e5m2)


def full_finetune(dm, file: Path | None) -> None:
    """Every weight of the diffusion model trains, as in diffusion-pipe's full fine-tune (embedders and the
    final layer included)."""
    from ..errors import ConfigError

    low = [(n, p.dtype) for n, p in dm.named_parameters() if p.dtype in LOW_PRECISION]
    if low:
        raise ConfigError(f"a full fine-tune (no [adapter] table) trains the weights themselves, and '{low[0][0]}' "
                          f"is stored in {str(low[0][1]).replace('torch.', '')}: load the model in bfloat16 (remove "
                          "diffusion_model_dtype or use a non-fp8 file), or train an adapter", file=file,
                          key="model.diffusion_model_dtype")
    dm.requires_grad_(True)


def model_save_dtype(cfg) -> torch.dtype:
    """save_dtype, else the model's dtype (diffusion-pipe saves in the training dtype)."""
    from ..models.base import DTYPES
    return DTYPES[cfg.save_dtype or cfg.model.dtype]


def write_stage_part(module, dm, folder: Path, stage: int, dtype: torch.dtype) -> None:
    """This stage's trained weights, under their diffusion-model keys, to ``folder/stageNNN.safetensors``."""
    from safetensors.torch import save_file

    names = {id(p): n for n, p in dm.named_parameters()}
    local = {names[id(p)]: p.detach().to("cpu", dtype).contiguous() for p in module.parameters()
             if p.requires_grad and id(p) in names}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(local, str(folder / f"stage{stage:03d}.safetensors"))


def merge_full_model(dm, source: Path, parts: Path, path: Path, dtype: torch.dtype, info: dict) -> int:
    """One single-file diffusion model with the source file's keys (and PipeTrain's metadata, which tiny
    models need): the stages' trained weights over this rank's copy of the rest. Written atomically."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if source.is_dir():   # a Diffusers folder: ComfyUI's keys for it (a file ComfyUI loads as the folder)
        from ..models.loading import comfy_layout, folder_meta_state_dict
        keys, metadata = set(comfy_layout(folder_meta_state_dict(source))[1]), {}
    else:
        with safe_open(str(source), framework="pt") as f:
            keys, metadata = {_unprefixed(k) for k in f.keys()}, dict(f.metadata() or {})
    own = dm.state_dict()
    sd = {k: own[k].detach().to("cpu", dtype if own[k].is_floating_point() else None) for k in keys if k in own}
    trained = 0
    for part in sorted(parts.glob("stage*.safetensors")):
        for k, v in load_file(str(part)).items():
            if k in sd:
                sd[k] = v
                trained += 1
    metadata.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in
                     {"pipetrain.full_finetune": info}.items()})
    injection.save_file(sd, path, metadata)
    return trained


def _unprefixed(key: str) -> str:
    for prefix in ("model.diffusion_model.", "diffusion_model."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def save_full_model(engine, adapter, cfg, run_dir: RunDir, reporter: RunReporter, topology: Topology, epoch: int,
                    step: int, at_step: bool, replace: bool, ema: bool = False) -> Path | None:
    """The trained diffusion model as one ComfyUI single file (``<run>/models/<run>-epoch0001.safetensors``):
    each stage's data-parallel rank 0 writes its weights, global rank 0 merges them (returns the path there).
    ``replace``: as write_lora's (a resumed run that trains an epoch again rewrites its file). ``ema``: the
    moving average, swapped into the weights by the caller, as ``…-ema`` with its own event."""
    name = run_dir.name
    stem = weights_stem(name, epoch, step, at_step, ema)
    parts = run_dir.path / f".parts-{stem}"
    dtype = model_save_dtype(cfg)
    dm = adapter.diffusion_model
    if topology.dp_rank == 0:
        write_stage_part(engine.module, dm, parts, engine.stage_id, dtype)
    distributed.barrier()
    path = None
    if topology.is_main:
        import shutil

        folder = run_dir.models
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{stem}.safetensors" if replace else unique_path(folder, stem)
        info = {"epoch": epoch, "step": step, "run": name}
        trained = merge_full_model(dm, adapter.model_files()["diffusion_model"][0], parts, path, dtype, info)
        shutil.rmtree(parts, ignore_errors=True)
        copy = without_secrets(run_dir.run_toml.read_text())   # the models folder is one users share
        atomic_write_bytes(Path(f"{path.with_suffix('')}.run.toml"), copy.encode())
        if ema:
            reporter.event("ema_saved", epoch=epoch, step=step, path=str(path), at_step=at_step)
        else:
            models = with_entry(reporter.status.get("models", []), {"epoch": epoch, "step": step, "path": str(path)})
            reporter.update(models=models)
            reporter.event("model_saved", epoch=epoch, step=step, path=str(path), at_step=at_step,
                           tensors_trained=trained)
    distributed.barrier()
    return path   # global rank 0: the epoch samples render with this model
