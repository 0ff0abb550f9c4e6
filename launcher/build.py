# SPDX-License-Identifier: GPL-3.0-or-later
"""Specs from the graph -> one validated ``RunConfig`` (+ its ``DatasetConfig``) written as TOML.

Validation is the backend's own (``backend.config`` rejects unknown keys, wrong types and out-of-range
values by name); this module only adds the checks that need the file system before anything starts.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..backend.config import DatasetConfig, RunConfig, save_toml
from ..backend.errors import ConfigError, DatasetError, ModelError
from ..backend.preflight import check_model, load_run
from ..backend.run.folder import RunDir
from ..backend.config.schema import from_dict
from .cluster_form import check_cluster, cluster_table
from .specs import DatasetSpec, TrainSpec

MEDIA_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".mp4", ".webm", ".mov"}
ARCHIVES = {".tar"}   # diffusion-pipe's image archives: the scan reads their members (data/dp_sources.py)
WHERE = "the PipeTrain nodes"


QUEUE_TIME_ENTRIES = 2000   # what a queue-time check looks at of a folder: the check runs on ComfyUI's event loop


def check_dataset_folder(path: str | Path, caption_extension: str = ".txt", look_at: int | None = None) -> None:
    """``DatasetError`` when the folder is missing or holds no image or video. It stops at the first one, so
    a folder of pictures is checked at once; ``look_at``: at most this many entries are looked at (a queue-time
    check, bounded whatever the folder holds: the rest is checked when the node runs)."""
    folder = Path(path)
    if not folder.is_dir():
        raise DatasetError(f"dataset folder {folder} does not exist; pick a folder under ComfyUI's input "
                           "directory or type an absolute path")
    with os.scandir(folder) as entries:    # an entry knows its type: no stat per file on most file systems
        for seen, e in enumerate(entries):
            if look_at is not None and seen >= look_at:
                return
            if (not e.name.startswith(".") and os.path.splitext(e.name)[1].lower() in MEDIA_SUFFIXES | ARCHIVES
                    and e.is_file()):
                return
    raise DatasetError(f"dataset folder {folder} contains no images or videos "
                       f"({', '.join(sorted(MEDIA_SUFFIXES))}); add files, each with a {caption_extension} caption")


def dataset_config(spec: DatasetSpec) -> DatasetConfig:
    return from_dict(DatasetConfig, spec.table(), file=WHERE)


def check_edit_pairs(ds: DatasetConfig, model_type: str, label: str) -> None:
    """An edit model's folders each have a control folder whose images pair with the training files by name
    (unpaired files listed); other models have none."""
    from ..backend.data import check_control_paths, scan_dataset
    from ..backend.models.registry import adapter_class

    check_control_paths(ds, adapter_class(model_type), label)
    if any(d.control_path is not None for d in ds.directory):
        try:
            scan_dataset(ds)    # raises naming a missing control folder or the unpaired files
        except DatasetError as e:
            # the answer goes to whoever queued the prompt (/history): counts, not the folders' file names
            raise DatasetError(f"{label}: {e.summary}") from None


EVAL_DATASET = "eval_dataset.toml"   # beside dataset.toml; the eval set's name is "eval"


# keys the launcher sets, not a node: where the run writes, its dataset file, its name (the Train node's prefix + an id)
LAUNCHER_KEYS = ("output_dir", "dataset", "run_name", "lora_dir", "eval_datasets")


def run_table(spec: TrainSpec, *, output_dir: str, dataset: str, run_name: str | None,
              lora_dir: str | None) -> dict:
    """The run file's table: every node's run keys, and the launcher's (``LAUNCHER_KEYS``)."""
    table = spec.run_keys().table()
    table.update(output_dir=output_dir, dataset=dataset, run_name=run_name, lora_dir=lora_dir)
    if spec.eval_dataset is not None:
        table["eval_datasets"] = [{"name": "eval", "config": str(Path(dataset).with_name(EVAL_DATASET))}]
    if spec.parallelism.cluster is not None:
        table["cluster"] = cluster_table(spec.parallelism.cluster)
    return {k: v for k, v in table.items() if v is not None}


def check_spec(spec: TrainSpec) -> None:
    """Everything that can be checked before a run directory exists; raises a ``PipeTrainError``."""
    for path, caption_extension in spec.dataset.folders() + (spec.eval_dataset.folders() if spec.eval_dataset else []):
        check_dataset_folder(path, caption_extension)
    m = spec.model
    for key, path in [("diffusion_model", m.get("model.diffusion_model")), ("vae", m.get("model.vae"))] + [
            (f"text_encoders[{i}]", p) for i, p in enumerate(m.get("model.text_encoders", ()))]:
        if path is not None and not Path(path).is_file():   # no vae: the checkpoint's own
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
    check_edit_pairs(dataset_config(spec.dataset), spec.model_type, "dataset")
    if spec.eval_dataset is not None:
        check_edit_pairs(dataset_config(spec.eval_dataset), spec.model_type, "eval dataset")
    cfg = from_dict(RunConfig, run_table(spec, output_dir="/", dataset="dataset.toml", run_name=None,
                                         lora_dir=None), file=WHERE)
    check_model(cfg.model, WHERE)   # the architecture's own rules (timestep range, CLIP vision, ...)
    cfg.check_world_size(world)
    from ..backend.optim.registry import resolve_optimizer
    resolve_optimizer(cfg)   # the optimizer exists and takes every argument given (before a run folder exists)


def write_config(spec: TrainSpec, folder: Path, *, output_dir: Path, run_name: str | None,
                 lora_dir: Path | None) -> Path:
    """Write ``dataset.toml`` + ``run.toml`` into ``folder``, load them back as the backend will; return run.toml."""
    check_spec(spec)
    run = RunDir(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_toml(dataset_config(spec.dataset), run.dataset_toml)
    if spec.eval_dataset is not None:
        save_toml(dataset_config(spec.eval_dataset), folder / EVAL_DATASET)
    table = run_table(spec, output_dir=str(output_dir), dataset=str(run.dataset_toml), run_name=run_name,
                      lora_dir=str(lora_dir) if lora_dir else None)
    save_toml(from_dict(RunConfig, table, file=run.run_toml), run.run_toml)
    load_run(run.run_toml)  # exactly what the backend will read
    return run.run_toml
