# SPDX-License-Identifier: GPL-3.0-or-later
"""What the nodes hand the Cache and Train nodes, which the launcher turns into one ``RunConfig``.

Settings are run keys (``RunPatch``: named as in the run file, defaults from the config fields, see
``backend/config/patch.py``). The specs here hold what exists in the UI alone: chained dataset folders, which
GPUs of this machine, the cluster form. Frozen dataclasses of plain values: hashable, so ComfyUI's executor
can cache node outputs on them, and free of ComfyUI or torch imports.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from ..backend.config import DatasetConfig
from ..backend.config.patch import RunPatch, default


@dataclass(frozen=True)
class DatasetSpec:
    """One or more folders (Dataset nodes chained); the keys of the whole dataset come from the first folder's node."""
    directories: tuple[RunPatch, ...]       # each folder's [[directory]] keys (``path`` absolute)
    shared: RunPatch = RunPatch()           # the dataset file's top-level keys
    run: RunPatch = RunPatch()              # run keys set on the Dataset node (the training dataset's count)

    def plus(self, other: "DatasetSpec") -> "DatasetSpec":
        return DatasetSpec(other.directories + self.directories, other.shared, other.run)

    def table(self) -> dict:
        return {**self.shared.table(), "directory": [d.table() for d in self.directories]}

    def folders(self) -> list[tuple[str, str]]:
        """(path, caption extension) of each folder."""
        ext = self.shared.get("caption_extension", default("caption_extension", DatasetConfig))
        return [(d.get("path"), d.get("caption_extension", ext)) for d in self.directories]


@dataclass(frozen=True)
class ClusterSpec:
    """Several machines through DeepSpeed's launcher (``[cluster]``; see ``launcher/cluster_form.py``)."""
    launcher: str = "pdsh"                      # pdsh | no_ssh | slurm | openmpi
    hosts: tuple[str, ...] = ()                 # "host:slots" entries, or
    hostfile: str = ""                          # an absolute path of a DeepSpeed hostfile
    master_addr: str = ""
    master_port: int = 29500
    env: tuple[tuple[str, str], ...] = ()       # forwarded to every node
    nccl_socket_ifname: str = ""
    nccl_ib_disable: Optional[bool] = None
    nccl_p2p_disable: Optional[bool] = None


@dataclass(frozen=True)
class ParallelismSpec:
    # 0: every GPU of the machine the run starts on, or one CPU rank where it has none (``on_machine``)
    gpus: int = 0
    gpu_ids: tuple[int, ...] = ()   # empty: the first ``gpus`` devices
    cluster: Optional[ClusterSpec] = None       # None: this machine only (``gpus``/``gpu_ids``)
    run: RunPatch = RunPatch()                  # pipeline_stages, micro_batch_size_per_gpu, partition_method, ...

    @property
    def devices(self) -> tuple[int, ...]:
        return self.gpu_ids or tuple(range(self.gpus))

    @property
    def auto_stages(self) -> bool:
        """No pipeline_stages set: the launcher's planner chooses them (``launcher/auto_parallel.py``)."""
        return "pipeline_stages" not in self.run.as_dict()

    @property
    def pipeline_stages(self) -> int:
        return self.run.get("pipeline_stages", default("pipeline_stages"))

    def on_machine(self, gpu_count: int) -> "ParallelismSpec":
        """``gpus`` 0 made concrete for a machine showing ``gpu_count`` GPUs (gpu_ids given: their count)."""
        if self.gpus or self.cluster is not None:
            return self
        return replace(self, gpus=len(self.gpu_ids) or max(gpu_count, 1))

    def with_stages(self, stages: int) -> "ParallelismSpec":
        return replace(self, run=self.run | RunPatch.of({"pipeline_stages": stages}))


@dataclass(frozen=True)
class RunHandle:
    """What the Train node outputs: the run's id (its folder name under the runs root)."""
    run_id: str


# Train without an Adapter node: a LoRA with [adapter]'s defaults (no [adapter] table would be a full fine-tune)
LORA = RunPatch.of({"type": "lora"}, "adapter")


@dataclass(frozen=True)
class TrainSpec:
    dataset: DatasetSpec
    model: RunPatch                 # model.* keys (the Model node)
    adapter: RunPatch = LORA
    optimizer: RunPatch = RunPatch()
    schedule: RunPatch = RunPatch()
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)
    memory: RunPatch = RunPatch()
    eval_dataset: Optional[DatasetSpec] = None     # held-out set (eval loss per timestep quantile)
    samples: Optional[RunPatch] = None             # samples.* keys

    @property
    def model_type(self) -> str:
        return self.model.get("model.type")

    def run_keys(self) -> RunPatch:
        """Every node's run keys in one patch (the nodes set disjoint keys)."""
        out = self.dataset.run
        for part in (self.model, self.adapter, self.optimizer, self.schedule, self.parallelism.run, self.memory,
                     self.samples or RunPatch()):
            out = out | part
        return out
