# SPDX-License-Identifier: GPL-3.0-or-later
"""Specs from the graph -> one validated ``RunConfig`` (+ its ``DatasetConfig``) written as TOML.

Validation is the backend's own (``backend.config`` rejects unknown keys, wrong types and out-of-range
values by name); this module only adds the checks that need the file system before anything starts.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..backend.config import DatasetConfig, RunConfig, load_run_config, save_toml
from ..backend.errors import ConfigError, DatasetError, ModelError
from ..backend.schema import from_dict
from .cluster import check_cluster, cluster_table
from .specs import DatasetSpec, MemorySpec, TrainSpec

MEDIA_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".mp4", ".webm", ".mov"}
WHERE = "the PipeTrain nodes"
FULL_FINETUNE = "full"


def check_dataset_folder(path: str | Path, caption_extension: str = ".txt") -> int:
    """Number of media files in ``path``; ``DatasetError`` when the folder is missing or has none."""
    folder = Path(path)
    if not folder.is_dir():
        raise DatasetError(f"dataset folder {folder} does not exist; pick a folder under ComfyUI's input "
                           "directory or type an absolute path")
    n = sum(1 for p in folder.iterdir() if p.is_file() and p.suffix.lower() in MEDIA_SUFFIXES
            and not p.name.startswith("."))
    if n == 0:
        raise DatasetError(f"dataset folder {folder} contains no images or videos "
                           f"({', '.join(sorted(MEDIA_SUFFIXES))}); add files, each with a {caption_extension} caption")
    return n


def dataset_config(spec: DatasetSpec) -> DatasetConfig:
    table = {
        "resolutions": list(spec.resolutions), "enable_ar_bucket": spec.enable_ar_bucket,
        "min_ar": spec.min_ar, "max_ar": spec.max_ar, "num_ar_buckets": spec.num_ar_buckets,
        "directory": [{"path": d.path, "num_repeats": d.num_repeats, "resolutions": list(d.resolutions),
                       "caption_extension": d.caption_extension, "caption_prefix": d.caption_prefix,
                       "shuffle_tags": d.shuffle_tags, "cache_shuffle_num": d.cache_shuffle_num,
                       "frame_buckets": list(d.frame_buckets),
                       **({"control_path": d.control_path} if d.control_path else {})} for d in spec.directories],
    }
    return from_dict(DatasetConfig, table, file=WHERE)


def check_edit_pairs(ds: DatasetConfig, model_type: str, label: str) -> None:
    """An edit model's folders each have a control folder whose images pair with the training files by name
    (unpaired files listed); other models have none."""
    from ..backend.data import check_control_paths, scan_dataset
    from ..backend.models.registry import adapter_class

    check_control_paths(ds, adapter_class(model_type), label)
    if any(d.control_path is not None for d in ds.directory):
        scan_dataset(ds)    # raises naming a missing control folder or listing the unpaired files


EVAL_DATASET = "eval_dataset.toml"   # beside dataset.toml; the eval set's name is "eval"


def checkpointing_mode(m: MemorySpec):
    """The Memory node's switches as ``activation_checkpointing``'s value."""
    if not m.activation_checkpointing:
        return False
    if m.offload_activations and m.selective:
        raise ConfigError("offload_activations and selective are two ways of checkpointing; turn one of them off",
                          file="Memory node", key="selective")
    return "unsloth" if m.offload_activations else "selective" if m.selective else True


def run_table(spec: TrainSpec, *, output_dir: str, dataset: str, run_name: str | None,
              lora_dir: str | None) -> dict:
    s, p, m = spec.schedule, spec.parallelism, spec.memory
    adapter = {k: v for k, v in dataclasses.asdict(spec.adapter).items() if v is not None}
    if "target_modules" in adapter:
        adapter["target_modules"] = list(adapter["target_modules"])
    if adapter.get("type") == FULL_FINETUNE:   # diffusion-pipe: no [adapter] table means a full fine-tune
        adapter = None
    o = spec.optimizer
    optimizer = {"type": o.type, "lr": o.lr, "weight_decay": o.weight_decay}
    if o.use_betas:
        optimizer.update(betas=list(o.betas), eps=o.eps)
    optimizer.update({k: list(v) if isinstance(v, tuple) else v for k, v in o.extra})
    model = {k: v for k, v in dataclasses.asdict(spec.model).items() if v is not None}
    model["text_encoders"] = list(model["text_encoders"])
    model["merge_adapters"] = list(model["merge_adapters"])
    table = {
        "output_dir": output_dir, "dataset": dataset, "epochs": s.epochs,
        "micro_batch_size_per_gpu": p.micro_batch_size_per_gpu, "pipeline_stages": p.pipeline_stages,
        "gradient_accumulation_steps": p.gradient_accumulation_steps, "warmup_steps": s.warmup_steps,
        "lr_scheduler": s.lr_scheduler, "save_every_n_epochs": s.save_every_n_epochs,
        "checkpoint_every_n_epochs": s.checkpoint_every_n_epochs,
        "checkpoint_every_n_minutes": s.checkpoint_every_n_minutes,
        "activation_checkpointing": checkpointing_mode(m), "seed": s.seed,
        "run_name": run_name, "lora_dir": lora_dir, "model": model, "adapter": adapter, "optimizer": optimizer,
        "save_every_n_steps": s.save_every_n_steps, "uncond_fraction": spec.dataset.uncond_fraction,
    }
    if spec.eval_dataset is not None:
        table["eval_datasets"] = [{"name": "eval", "config": str(Path(dataset).with_name(EVAL_DATASET))}]
        table["eval_every_n_epochs"] = s.eval_every_n_epochs
        table["eval_every_n_steps"] = s.eval_every_n_steps
    if spec.samples is not None:
        samples = dataclasses.asdict(spec.samples)
        table["samples"] = {**samples, "prompts": list(samples["prompts"])}
    if m.blocks_to_swap:
        table["blocks_to_swap"] = m.blocks_to_swap
    if m.compile:
        table["compile"] = True
        if m.memory_budget < 1:
            table["activation_memory_budget"] = m.memory_budget
    if m.activation_checkpointing and m.checkpoint_fraction < 1:
        table["activation_checkpointing_fraction"] = m.checkpoint_fraction
    if p.cluster is not None:
        table["cluster"] = cluster_table(p.cluster)
    return {k: v for k, v in table.items() if v is not None}


def check_spec(spec: TrainSpec) -> None:
    """Everything that can be checked before a run directory exists; raises a ``PipeTrainError``."""
    for d in spec.dataset.directories + (spec.eval_dataset.directories if spec.eval_dataset else ()):
        check_dataset_folder(d.path, d.caption_extension)
    for key, path in [("diffusion_model", spec.model.diffusion_model), ("vae", spec.model.vae)] + [
            (f"text_encoders[{i}]", p) for i, p in enumerate(spec.model.text_encoders)]:
        if not Path(path).is_file():
            raise ModelError(f"model file {path} ({key}) not found")
    p = spec.parallelism
    world = p.gpus
    if p.cluster is not None:
        world = check_cluster(p.cluster, p.pipeline_stages)   # the hosts' slots, not ``gpus``
        if p.gpu_ids:
            raise ConfigError(f"gpu_ids {list(p.gpu_ids)} apply to one machine; on a cluster each host uses its "
                              "first <slots> GPUs: leave gpu_ids empty", file=WHERE, key="gpu_ids")
    elif p.gpus % p.pipeline_stages:
        raise ConfigError(f"pipeline_stages={p.pipeline_stages} does not divide gpus={p.gpus}; "
                          f"use a GPU count that is a multiple of {p.pipeline_stages}", file=WHERE, key="pipeline_stages")
    elif p.gpu_ids and len(p.gpu_ids) != p.gpus:
        raise ConfigError(f"{len(p.gpu_ids)} gpu_ids given for gpus={p.gpus}", file=WHERE, key="gpu_ids")
    check_edit_pairs(dataset_config(spec.dataset), spec.model.type, "dataset")
    if spec.eval_dataset is not None:
        check_edit_pairs(dataset_config(spec.eval_dataset), spec.model.type, "eval dataset")
    cfg = from_dict(RunConfig, run_table(spec, output_dir="/", dataset="dataset.toml", run_name=None,
                                         lora_dir=None), file=WHERE)
    cfg.check_world_size(world)
    from ..backend.optim import resolve_optimizer
    resolve_optimizer(cfg)   # the optimizer exists and takes every argument given (before a run folder exists)


def write_config(spec: TrainSpec, folder: Path, *, output_dir: Path, run_name: str | None,
                 lora_dir: Path | None) -> Path:
    """Write ``dataset.toml`` + ``run.toml`` into ``folder``, load them back as the backend will; return run.toml."""
    check_spec(spec)
    folder.mkdir(parents=True, exist_ok=True)
    save_toml(dataset_config(spec.dataset), folder / "dataset.toml")
    if spec.eval_dataset is not None:
        save_toml(dataset_config(spec.eval_dataset), folder / EVAL_DATASET)
    table = run_table(spec, output_dir=str(output_dir), dataset=str(folder / "dataset.toml"), run_name=run_name,
                      lora_dir=str(lora_dir) if lora_dir else None)
    save_toml(from_dict(RunConfig, table, file=folder / "run.toml"), folder / "run.toml")
    load_run_config(folder / "run.toml")  # exactly what the backend will read
    return folder / "run.toml"
