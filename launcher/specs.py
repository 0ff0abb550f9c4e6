# SPDX-License-Identifier: GPL-3.0-or-later
"""Typed, serialisable specs that the nodes build and the launcher turns into one ``RunConfig``.

Plain frozen dataclasses of plain values (strings, numbers, tuples): hashable, so ComfyUI's executor
can cache node outputs on them, and free of ComfyUI or torch imports.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass(frozen=True)
class DirectorySpec:
    path: str                       # absolute, resolved by the Dataset node
    num_repeats: int = 1
    resolutions: tuple[int, ...] = (512,)
    caption_extension: str = ".txt"
    caption_prefix: str = ""            # before every caption of this folder
    shuffle_tags: bool = False          # one tag-shuffled variant per caption (cache_shuffle_num 1)
    cache_shuffle_num: int = 0          # N tag-shuffled variants per caption, each its own example
    frame_buckets: tuple[int, ...] = (1,)   # video models: clip lengths in frames
    control_path: str = ""              # edit models: the folder of control images named like the files


@dataclass(frozen=True)
class DatasetSpec:
    """One or more folders; settings shared by the whole dataset come from the first folder's node."""
    directories: tuple[DirectorySpec, ...]
    resolutions: tuple[int, ...] = (512,)
    enable_ar_bucket: bool = True
    min_ar: float = 0.5
    max_ar: float = 2.0
    num_ar_buckets: int = 7
    uncond_fraction: float = 0.0    # caption dropout (a run key: the training dataset's value counts)

    def plus(self, other: "DatasetSpec") -> "DatasetSpec":
        return DatasetSpec(other.directories + self.directories, other.resolutions, other.enable_ar_bucket,
                           other.min_ar, other.max_ar, other.num_ar_buckets, other.uncond_fraction)


@dataclass(frozen=True)
class ModelSpec:
    type: str                       # a model type (models/registry.py), detected from the diffusion model file
    diffusion_model: str            # absolute paths
    vae: str
    text_encoders: tuple[str, ...]
    dtype: str = "bfloat16"
    diffusion_model_dtype: Optional[str] = None
    clip_vision: Optional[str] = None     # Wan 2.1 i2v: the CLIP-vision file
    min_t: Optional[float] = None         # timestep range (Wan 2.2 experts)
    max_t: Optional[float] = None
    merge_adapters: tuple[str, ...] = ()  # LoRAs baked into the base weights before training


@dataclass(frozen=True)
class AdapterSpec:
    rank: int = 16
    alpha: Optional[float] = None
    dropout: float = 0.0
    target_modules: Optional[tuple[str, ...]] = None
    type: str = "lora"              # lora | lokr | full (no [adapter] table: every weight trains)
    decompose_factor: int = -1      # lokr


@dataclass(frozen=True)
class OptimizerSpec:
    type: str = "adamw"
    lr: float = 2e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.01
    eps: float = 1e-8
    # further constructor arguments, as sorted (key, value) pairs (lists as tuples, so the spec stays hashable)
    extra: tuple[tuple[str, object], ...] = ()
    use_betas: bool = True          # False for optimizers without betas / eps (sgd)


@dataclass(frozen=True)
class ScheduleSpec:
    epochs: int = 10
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    save_every_n_epochs: int = 1
    checkpoint_every_n_epochs: Optional[int] = None
    checkpoint_every_n_minutes: Optional[float] = 30.0
    seed: int = 42
    save_every_n_steps: Optional[int] = None
    eval_every_n_epochs: Optional[int] = None
    eval_every_n_steps: Optional[int] = None


@dataclass(frozen=True)
class ClusterSpec:
    """Several machines through DeepSpeed's launcher (``[cluster]``; see ``launcher/cluster.py``)."""
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
    gpus: int = 1
    gpu_ids: tuple[int, ...] = ()   # empty: the first ``gpus`` devices
    pipeline_stages: int = 1
    micro_batch_size_per_gpu: int = 1
    gradient_accumulation_steps: int = 1
    cluster: Optional[ClusterSpec] = None       # None: this machine only (``gpus``/``gpu_ids``)

    @property
    def devices(self) -> tuple[int, ...]:
        return self.gpu_ids or tuple(range(self.gpus))


@dataclass(frozen=True)
class MemorySpec:
    activation_checkpointing: bool = True
    blocks_to_swap: int = 0
    offload_activations: bool = False   # with activation_checkpointing: 'unsloth' (block inputs in CPU memory)
    compile: bool = False               # torch.compile each block (speed, not memory; it lives with the savers)
    checkpoint_fraction: float = 1.0    # with activation_checkpointing: the share of blocks checkpointed
    memory_budget: float = 1.0          # with compile: activation_memory_budget (1: off)
    selective: bool = False             # with activation_checkpointing: 'selective' (attention outputs etc. kept)


@dataclass(frozen=True)
class SamplesSpec:
    """[samples]: images rendered with each saved epoch LoRA."""
    prompts: tuple[str, ...]
    negative_prompt: str = ""
    seed: int = 0
    width: int = 1024
    height: int = 1024
    steps: int = 20
    cfg: float = 1.0
    guidance: float = 3.5
    sampler: str = "euler"
    scheduler: str = "simple"
    render: str = "host"            # "host": the ComfyUI that started the run renders them; "run": the run does
    host_timeout_s: float = 900.0   # then the run renders them itself


@dataclass(frozen=True)
class RunHandle:
    """What the Train node outputs: the run's id (its folder name under the runs root)."""
    run_id: str


@dataclass(frozen=True)
class TrainSpec:
    dataset: DatasetSpec
    model: ModelSpec
    adapter: AdapterSpec = field(default_factory=AdapterSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)
    memory: MemorySpec = field(default_factory=MemorySpec)
    eval_dataset: Optional[DatasetSpec] = None     # held-out set (eval loss per timestep quantile)
    samples: Optional[SamplesSpec] = None

    def as_dict(self) -> dict:
        return asdict(self)
