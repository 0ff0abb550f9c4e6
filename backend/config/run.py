"""``RunConfig``: the run file's top-level keys and the tree of sections under them."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

from . import compat
from ..errors import ConfigError
from .common import check_folder, config_path, replace
from .dataset import DatasetConfig
from .model import AdapterConfig, Dtype, ModelConfig
from .patch import widget
from .sections import (SAMPLE_FILES, ClusterConfig, EvalDatasetConfig, MonitoringConfig, OptimizerConfig,
                       SamplesConfig)

EMA_DECAY = 0.999   # the average follows about the last 1 / (1 - decay) = 1000 steps
PRESERVATION_CLASS = "person"   # ai-toolkit's default diff_output_preservation_class


@dataclass
class RunConfig:
    output_dir: str
    dataset: str
    model: ModelConfig
    epochs: int = 10
    max_steps: Optional[int] = None
    micro_batch_size_per_gpu: int = 1
    image_micro_batch_size_per_gpu: Optional[int] = None   # one-frame buckets (images); default the one above
    # per bucket size: [[resolution, batch], ...], the entry nearest the bucket's sqrt(width x height) (diffusion-pipe
    # writes these lists as micro_batch_size_per_gpu / image_micro_batch_size_per_gpu themselves)
    micro_batch_size_by_resolution: Optional[list[list[int]]] = None
    image_micro_batch_size_by_resolution: Optional[list[list[int]]] = None
    pipeline_stages: int = 1
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 1.0
    warmup_steps: int = 0
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    # diffusion-pipe's: every parameter group trains at this rate on a constant schedule (no warm-up), a resumed run
    # too (its checkpoint's schedule and rates are not taken, its optimizer state is); left out: the schedule above
    force_constant_lr: Optional[float] = None
    save_every_n_epochs: Optional[int] = 1      # diffusion-pipe has no default (one save_every_* is required)
    save_every_n_steps: Optional[int] = None
    save_every_n_examples: Optional[int] = None  # converted to steps: // global batch size
    eval_datasets: list[EvalDatasetConfig] = field(default_factory=list)  # a bare path is named eval<i>
    eval_every_n_epochs: Optional[int] = None
    eval_every_n_steps: Optional[int] = None
    eval_every_n_examples: Optional[int] = None
    eval_before_first_step: bool = True
    eval_micro_batch_size_per_gpu: Optional[int] = None   # default micro_batch_size_per_gpu
    eval_image_micro_batch_size_per_gpu: Optional[int] = None   # default eval_micro_batch_size_per_gpu
    # the eval batches per bucket size, as the two training lists above (diffusion-pipe writes them as the eval keys
    # themselves); left out, eval batches as training does (diffusion-pipe's default: the eval micro batch is the
    # training one, lists included)
    eval_micro_batch_size_by_resolution: Optional[list[list[int]]] = None
    eval_image_micro_batch_size_by_resolution: Optional[list[list[int]]] = None
    eval_gradient_accumulation_steps: int = 1
    uncond_fraction: float = 0.0                 # caption dropout: train with the empty caption this often
    # the loss on the model's own target (models/losses.py); left out: mse, or diffusion-pipe's choice by key
    # (huber_delta set: huber; smooth_l1_beta set: smooth_l1)
    loss_type: Optional[Literal["mse", "l1", "huber", "smooth_l1"]] = field(default=None, metadata=widget("mse"))
    huber_delta: Optional[float] = field(default=None, metadata=widget(1.0))       # huber (default 1.0)
    smooth_l1_beta: Optional[float] = field(default=None, metadata=widget(1.0))    # smooth_l1 (default 1.0)
    noise_offset: float = 0.0                    # ai-toolkit's: noise + noise_offset * N(0, 1) per sample and channel
    checkpoint_every_n_epochs: Optional[int] = None
    checkpoint_every_n_minutes: Optional[float] = None
    # 'unsloth': inputs parked in CPU memory; 'selective': attention and MLP down-projection outputs kept
    activation_checkpointing: Union[bool, Literal["unsloth", "selective"]] = False
    activation_checkpointing_fraction: float = 1.0   # the share of blocks checkpointed (evenly spread)
    blocks_to_swap: int = 0                      # per stage: frozen block weights kept in CPU memory (swap.py)
    compile: bool = False                        # torch.compile each transformer block (compiled once, reused)
    activation_memory_budget: Optional[float] = None   # with compile: share of activations kept (compiling.py)
    compile_cuda_graphs: bool = True             # with compile: replay regions as CUDA graphs where it pays (SDXL)
    fp8_compute: bool = False                    # adapters: frozen base linears multiply in FP8 (models/fp8.py)
    # "auto": the trainer picks activation_checkpointing(_fraction) and blocks_to_swap that fit the GPU
    # (memory/plan.py); memory_limit_gib: plan for this much of each GPU instead of all of it
    memory: Literal["manual", "auto"] = "manual"
    memory_limit_gib: Optional[float] = None
    partition_method: Literal["parameters", "uniform", "compute", "manual"] = "compute"
    partition_split: Optional[list[int]] = None
    save_dtype: Optional[Dtype] = None
    # an exponential moving average of the trained weights, saved beside each LoRA as <name>-ema (train/ema.py)
    ema: bool = False
    # the share of the average each optimizer step keeps; left out: EMA_DECAY
    ema_decay: Optional[float] = field(default=None, metadata=widget(EMA_DECAY))
    # differential output preservation (ai-toolkit's keys, train/preservation.py): the base model's prediction for
    # each caption with trigger_word swapped for the class is the target of the adapted model's on that caption;
    # the multiplier weighs that loss (left out: 1.0), the class left out is 'person'
    diff_output_preservation: bool = False
    diff_output_preservation_multiplier: Optional[float] = field(default=None, metadata=widget(1.0))
    diff_output_preservation_class: Optional[str] = field(default=None, metadata=widget(PRESERVATION_CLASS))
    trigger_word: Optional[str] = None           # the word of the captions that names what the LoRA learns
    caching_batch_size: int = 1
    steps_per_print: int = 1
    seed: int = 42
    lora_dir: Optional[str] = None
    run_name: Optional[str] = None
    # "diffusion-pipe": each save also as <run>/epochN/adapter_model.safetensors (+ adapter_config.json, the config)
    # and each checkpoint linked as <run>/global_stepN, where diffusion-pipe's scripts look (train/dp_layout.py)
    run_layout: Literal["pipetrain", "diffusion-pipe"] = "pipetrain"
    adapter: Optional[AdapterConfig] = None      # no [adapter] table: full fine-tune (diffusion-pipe's meaning)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    cluster: Optional[ClusterConfig] = None
    samples: Optional[SamplesConfig] = None
    monitoring: Optional[MonitoringConfig] = None
    # what load_run_config attaches (not written back into run.toml): the dataset files, read once, and the
    # file this config came from
    _dataset: Optional[DatasetConfig] = None
    _evals: Optional[dict[str, DatasetConfig]] = None
    _file: Optional[Path] = None

    UNSUPPORTED = compat.RUN
    preprocess = classmethod(lambda cls, data, file, prefix: _named_evals(compat.preprocess_run(data, file, prefix)))

    def validate(self, file):
        check_folder(self.output_dir, file, "output_dir")
        if self.lora_dir:
            check_folder(self.lora_dir, file, "lora_dir")
        for key in ("epochs", "micro_batch_size_per_gpu", "pipeline_stages", "gradient_accumulation_steps",
                    "caching_batch_size", "steps_per_print", "eval_gradient_accumulation_steps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"got {getattr(self, key)}; must be 1 or more", file=file, key=key)
        for key in ("save_every_n_epochs", "save_every_n_steps", "save_every_n_examples", "checkpoint_every_n_epochs",
                    "max_steps", "eval_every_n_epochs", "eval_every_n_steps", "eval_every_n_examples",
                    "eval_micro_batch_size_per_gpu", "image_micro_batch_size_per_gpu",
                    "eval_image_micro_batch_size_per_gpu"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"got {value}; must be 1 or more (or leave it out)", file=file, key=key)
        if self.force_constant_lr is not None and not self.force_constant_lr > 0:
            raise ConfigError(f"got {self.force_constant_lr}; a learning rate above 0 (or leave it out)", file=file,
                              key="force_constant_lr")
        if not 0 <= self.uncond_fraction < 1:
            raise ConfigError(f"got {self.uncond_fraction}; must be in [0, 1)", file=file, key="uncond_fraction")
        check_loss(self, file)
        check_preservation(self, file)
        names = [e.name for e in self.eval_datasets]
        if len(set(names)) != len(names):
            raise ConfigError(f"got names {names}; each eval dataset needs its own name", file=file,
                              key="eval_datasets")
        if self.ema_decay is not None:
            if not 0 < self.ema_decay < 1:
                raise ConfigError(f"got {self.ema_decay}; must be between 0 and 1, e.g. 0.999 (the share of the "
                                  "average each step keeps; 1 - decay goes to the new weights)", file=file,
                                  key="ema_decay")
            if not self.ema:
                raise ConfigError("a decay without the average: set ema = true too, or leave ema_decay out",
                                  file=file, key="ema_decay")
        if self.checkpoint_every_n_minutes is not None and self.checkpoint_every_n_minutes <= 0:
            raise ConfigError("must be > 0 (or leave it out)", file=file, key="checkpoint_every_n_minutes")
        if not 0 < self.activation_checkpointing_fraction <= 1:
            raise ConfigError(f"got {self.activation_checkpointing_fraction}; must be in (0, 1] (1: every block)",
                              file=file, key="activation_checkpointing_fraction")
        if self.activation_checkpointing_fraction < 1 and not self.activation_checkpointing:
            raise ConfigError("a share of the blocks to checkpoint needs activation_checkpointing = true (or "
                              "'unsloth' or 'selective'); set both, or leave the fraction out", file=file,
                              key="activation_checkpointing_fraction")
        if self.activation_memory_budget is not None:
            if not 0 <= self.activation_memory_budget <= 1:
                raise ConfigError(f"got {self.activation_memory_budget}; must be in [0, 1] (1: keep every activation, "
                                  "0: recompute all that can be)", file=file, key="activation_memory_budget")
            if not self.compile:
                raise ConfigError("the budget is applied by torch.compile's partitioner: set compile = true, or leave "
                                  "activation_memory_budget out (activation_checkpointing saves memory without "
                                  "compile)", file=file, key="activation_memory_budget")
        for key in ("micro_batch_size_by_resolution", "image_micro_batch_size_by_resolution",
                    "eval_micro_batch_size_by_resolution", "eval_image_micro_batch_size_by_resolution"):
            pairs = getattr(self, key)
            if pairs is not None and (not pairs or any(len(p) != 2 or p[0] < 64 or p[1] < 1 for p in pairs)):
                raise ConfigError(f"got {pairs}; give [[resolution, batch], ...] with resolutions from 64 and "
                                  "batches of 1 or more, e.g. [[512, 4], [1024, 1]]", file=file, key=key)
        if self.memory_limit_gib is not None and not 0 < self.memory_limit_gib <= 4096:
            raise ConfigError(f"got {self.memory_limit_gib}; the GiB of each GPU a run may plan for, up to 4096 "
                              "(or leave it out: the whole GPU)", file=file, key="memory_limit_gib")
        if self.samples is not None and self.adapter is None and self.samples.strengths != [1.0]:
            raise ConfigError(f"got {self.samples.strengths}; a full fine-tune saves whole models, which have no "
                              "strength: leave samples.strengths out", file=file, key="samples.strengths")
        if self.blocks_to_swap < 0:
            raise ConfigError(f"got {self.blocks_to_swap}; must be 0 or more", file=file, key="blocks_to_swap")
        if self.blocks_to_swap and self.adapter is None:
            raise ConfigError("block swapping keeps frozen weights in CPU memory, and a full fine-tune (no [adapter] "
                              "table) trains them all; set blocks_to_swap = 0, or train an adapter", file=file,
                              key="blocks_to_swap")
        if self.fp8_compute and (self.adapter is None or self.blocks_to_swap):
            raise ConfigError("FP8 compute turns each frozen base weight into FP8 on the GPU: it needs an "
                              "[adapter] table (a full fine-tune trains the base weights) and blocks_to_swap = 0; "
                              "set fp8_compute = false, or change those", file=file, key="fp8_compute")
        if self.partition_method == "manual":
            if not self.partition_split or len(self.partition_split) != self.pipeline_stages - 1:
                raise ConfigError(
                    f"partition_method = 'manual' needs partition_split with {self.pipeline_stages - 1} layer indices",
                    file=file, key="partition_split")

    # --- derived ---------------------------------------------------------------------------
    @property
    def average_decay(self) -> float:
        """``ema_decay``, or its default where the file leaves it out."""
        return EMA_DECAY if self.ema_decay is None else self.ema_decay

    @property
    def preservation_class(self) -> str:
        """``diff_output_preservation_class``, or its default where the file leaves it out."""
        return self.diff_output_preservation_class or PRESERVATION_CLASS

    @property
    def preservation_multiplier(self) -> float:
        """``diff_output_preservation_multiplier``, or 1.0 where the file leaves it out."""
        m = self.diff_output_preservation_multiplier
        return 1.0 if m is None else m

    @property
    def loss_kind(self) -> str:
        """The loss that trains: loss_type, else diffusion-pipe's choice by which parameter its file sets."""
        if self.loss_type is not None:
            return self.loss_type
        given = [kind for key, kind in LOSS_PARAMETERS.items() if getattr(self, key) is not None]
        return given[0] if given else "mse"

    @property
    def file(self) -> Path | None:
        """The TOML file this config was loaded from (None: built in memory); errors name it."""
        return self._file

    @property
    def dataset_config(self) -> DatasetConfig:
        """The dataset file's config, read by ``load_run_config``."""
        if self._dataset is None:
            raise ConfigError("the dataset file is read by load_run_config; this config was built without it",
                              file=self._file, key="dataset")
        return self._dataset

    def eval_dataset_configs(self) -> dict[str, DatasetConfig]:
        """Each eval dataset's config by name, read by ``load_run_config``."""
        if self._evals is None and self.eval_datasets:
            raise ConfigError("the eval dataset files are read by load_run_config; this config was built without "
                              "them", file=self._file, key="eval_datasets")
        return self._evals or {}

    def check_model_paths(self) -> None:
        """A model path that is a folder must hold safetensors weights (a Diffusers component folder, e.g. what
        diffusion-pipe's diffusers_path names); otherwise it fails here, naming the key."""
        from ..errors import ModelError
        from .model_folders import weight_files
        for key, path in self.model.file_paths():
            if self.resolve(path).is_dir():
                try:
                    weight_files(self.resolve(path))
                except ModelError as exc:
                    raise ConfigError(f"{exc}. {compat.SINGLE_FILES_HINT}", file=self._file, key=key) from None

    def resolve(self, path: str | Path) -> Path:
        """A path from this config: relative ones from the TOML file's folder, or the working directory where only
        that holds it (``common.config_path``)."""
        p = Path(path).expanduser()
        if p.is_absolute() or self._file is None:
            return p
        return config_path(self._file.parent, p).resolve()

    def with_absolute_paths(self) -> "RunConfig":
        """A copy whose file paths no longer depend on where the TOML lives (for copies in run folders)."""
        r = self.resolve
        model = dataclasses.replace(self.model, diffusion_model=str(r(self.model.diffusion_model)),
                                    vae=str(r(self.model.vae)) if self.model.vae else None,
                                    text_encoders=[str(r(p)) for p in self.model.text_encoder_files])
        adapter = self.adapter
        if adapter is not None and adapter.init_from_existing:
            adapter = dataclasses.replace(adapter, init_from_existing=str(r(adapter.init_from_existing)))
        evals = [dataclasses.replace(e, config=str(r(e.config))) for e in self.eval_datasets]
        cluster = self.cluster
        if cluster is not None and cluster.hostfile:
            cluster = dataclasses.replace(cluster, hostfile=str(r(cluster.hostfile)))
        samples = self.samples
        if samples is not None:
            samples = dataclasses.replace(samples, **{key: str(r(getattr(samples, key))) for key in SAMPLE_FILES
                                                      if getattr(samples, key)})
        return replace(self, output_dir=str(r(self.output_dir)), dataset=str(r(self.dataset)), model=model,
                       adapter=adapter, cluster=cluster, eval_datasets=evals, samples=samples,
                       lora_dir=str(r(self.lora_dir)) if self.lora_dir else None)

    def check_world_size(self, world_size: int) -> None:
        if world_size % self.pipeline_stages:
            raise ConfigError(
                f"pipeline_stages={self.pipeline_stages} does not divide the {world_size} ranks; "
                f"use a number of GPUs that is a multiple of {self.pipeline_stages}",
                file=self._file, key="pipeline_stages")



LOSS_PARAMETERS = {"huber_delta": "huber", "smooth_l1_beta": "smooth_l1"}   # key -> the loss it belongs to


def check_loss(cfg: RunConfig, file) -> None:
    """loss_type and its parameter, and noise_offset."""
    given = [k for k in LOSS_PARAMETERS if getattr(cfg, k) is not None]
    if len(given) == 2:
        raise ConfigError("give huber_delta (huber loss) or smooth_l1_beta (smooth L1 loss), not both", file=file,
                          key="smooth_l1_beta")
    for key in given:
        value, kind = getattr(cfg, key), LOSS_PARAMETERS[key]
        if not value > 0:
            raise ConfigError(f"got {value}; must be > 0 (1.0 is the usual value)", file=file, key=key)
        if cfg.loss_kind != kind:
            raise ConfigError(f"a parameter of the {kind} loss, and loss_type is {cfg.loss_type!r}: set "
                              f"loss_type = '{kind}' (or leave it out), or remove {key}", file=file, key=key)
    if not 0 <= cfg.noise_offset <= 1:
        raise ConfigError(f"got {cfg.noise_offset}; must be in [0, 1] (0: off; 0.05 to 0.1 are usual)", file=file,
                          key="noise_offset")


def check_preservation(cfg: RunConfig, file) -> None:
    """diff_output_preservation and the keys that go with it."""
    m = cfg.diff_output_preservation_multiplier
    if m is not None and not 0 <= m < float("inf"):
        raise ConfigError(f"got {m}; must be 0 or more (1.0: the preservation loss weighs as much as the training "
                          "loss)", file=file, key="diff_output_preservation_multiplier")
    if not cfg.diff_output_preservation:
        for key in ("diff_output_preservation_multiplier", "diff_output_preservation_class", "trigger_word"):
            if getattr(cfg, key) is not None:
                raise ConfigError(f"{key} is read by differential output preservation only: set "
                                  "diff_output_preservation = true too, or leave it out", file=file, key=key)
        return
    trigger = (cfg.trigger_word or "").strip()
    if not trigger:
        raise ConfigError("differential output preservation swaps the trigger word of each caption for its class: "
                          "set trigger_word to the word your captions name the subject with, e.g. 'sks'", file=file,
                          key="trigger_word")
    cls = cfg.diff_output_preservation_class
    if cls is not None and (not cls.strip() or cls.strip() == trigger):
        raise ConfigError(f"got {cls!r}; give the class the trigger word's subject belongs to, e.g. 'person' or "
                          "'dog' (other than the trigger word)", file=file, key="diff_output_preservation_class")
    if cfg.adapter is None:
        raise ConfigError("the preservation target is the model without its adapter, and a full fine-tune (no "
                          "[adapter] table) has none: add an [adapter] table, or set diff_output_preservation = "
                          "false", file=file, key="diff_output_preservation")


def _named_evals(data: dict) -> dict:
    """A bare path in ``eval_datasets`` is the table ``{name = "eval<i>", config = path}``."""
    if isinstance(data.get("eval_datasets"), list):
        data["eval_datasets"] = [{"name": f"eval{i}", "config": e} if isinstance(e, str) else e
                                 for i, e in enumerate(data["eval_datasets"])]
    return data
