"""The typed run configuration, loaded from and saved to TOML with diffusion-pipe's key names.

``RunConfig`` is the tree of each component's own small config. Loading rejects unknown keys, wrong
types and out-of-range values before anything starts, naming the file and the key.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

import tomli_w

from . import compat
from .errors import ConfigError
from .schema import from_dict, to_dict

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Dtype = Literal["float32", "bfloat16", "float16"]
WeightDtype = Literal["float32", "bfloat16", "float16", "float8", "float8_e4m3fn", "float8_e5m2"]


@dataclass
class DirectoryConfig:
    """One [[directory]]; unset keys take the dataset file's top-level value."""
    path: str
    num_repeats: Optional[int] = None
    resolutions: Optional[list[int]] = None
    caption_extension: Optional[str] = None
    caption_prefix: Optional[str] = None
    shuffle_tags: Optional[bool] = None
    cache_shuffle_num: Optional[int] = None
    cache_shuffle_delimiter: Optional[str] = None
    skip_empty_caption: Optional[bool] = None
    frame_buckets: Optional[list[int]] = None   # video models: clip lengths in frames (see DatasetConfig)
    control_path: Optional[str] = None          # edit models: control images paired by file stem

    UNSUPPORTED = compat.DIRECTORY
    preprocess = classmethod(lambda cls, data, file, prefix: compat.preprocess_dataset(data, file, prefix))

    def validate(self, file):
        if self.num_repeats is not None and self.num_repeats < 1:
            raise ConfigError(f"got {self.num_repeats}; must be 1 or more", file=file, key="directory.num_repeats")
        if self.cache_shuffle_num is not None and self.cache_shuffle_num < 0:
            raise ConfigError("must be 0 or more", file=file, key="directory.cache_shuffle_num")
        if self.frame_buckets is not None:
            _check_frame_buckets(self.frame_buckets, file, "directory.frame_buckets")


def _check_frame_buckets(buckets: list[int], file, key: str) -> None:
    if not buckets or any(f < 1 for f in buckets):
        raise ConfigError(f"got {buckets}; give frame counts of 1 or more, e.g. [1, 17, 33]", file=file, key=key)


@dataclass(frozen=True)
class CaptionOptions:
    """How one directory's captions become the texts that are encoded and trained on."""
    prefix: str = ""
    shuffle_num: int = 0          # shuffled variants per caption, each its own example (0: the caption as is)
    delimiter: str = ", "
    skip_empty: bool = False


@dataclass
class DatasetConfig:
    directory: list[DirectoryConfig]
    resolutions: list[int] = field(default_factory=lambda: [512])
    enable_ar_bucket: bool = False
    min_ar: float = 0.5
    max_ar: float = 2.0
    num_ar_buckets: int = 7
    num_repeats: int = 1
    caption_extension: str = ".txt"
    on_unreadable: Literal["skip", "error"] = "skip"
    caption_prefix: str = ""               # prepended to every caption (outside any shuffling)
    shuffle_tags: bool = False             # true alone = cache_shuffle_num 1 (one shuffled variant)
    cache_shuffle_num: int = 0             # N shuffled variants of each caption, each its own example
    cache_shuffle_delimiter: str = ", "
    skip_empty_caption: bool = False       # true: leave out images without a caption (else: empty caption)
    # video models: each video trains as one clip of the largest of these frame counts it fills at the
    # model's frame rate, taken from its start (1 = still images; a video never goes to 1)
    frame_buckets: list[int] = field(default_factory=lambda: [1])
    # where relative directory paths are resolved; set from the file's location, not written back
    _base: Optional[Path] = None

    UNSUPPORTED = compat.DATASET
    preprocess = classmethod(lambda cls, data, file, prefix: compat.preprocess_dataset(data, file, prefix))

    def validate(self, file):
        if not self.directory:
            raise ConfigError("at least one [[directory]] is required", file=file, key="directory")
        if not self.resolutions or any(r < 64 or r % 64 for r in self.resolutions):
            raise ConfigError(f"got {self.resolutions}; each resolution must be a multiple of 64, at least 64",
                              file=file, key="resolutions")
        if not 0 < self.min_ar <= 1 <= self.max_ar:
            raise ConfigError(f"got min_ar={self.min_ar}, max_ar={self.max_ar}; need 0 < min_ar <= 1 <= max_ar",
                              file=file, key="min_ar")
        if self.num_ar_buckets < 1:
            raise ConfigError("must be 1 or more", file=file, key="num_ar_buckets")
        if self.num_repeats < 1:
            raise ConfigError("must be 1 or more", file=file, key="num_repeats")
        if self.cache_shuffle_num < 0:
            raise ConfigError("must be 0 or more", file=file, key="cache_shuffle_num")
        _check_frame_buckets(self.frame_buckets, file, "frame_buckets")

    def caption_options(self, d: DirectoryConfig) -> CaptionOptions:
        def pick(name):
            value = getattr(d, name)
            return getattr(self, name) if value is None else value
        shuffle_num = pick("cache_shuffle_num")
        if shuffle_num == 0 and pick("shuffle_tags"):
            shuffle_num = 1
        return CaptionOptions(prefix=pick("caption_prefix"), shuffle_num=shuffle_num,
                              delimiter=pick("cache_shuffle_delimiter"), skip_empty=pick("skip_empty_caption"))

    def with_absolute_paths(self) -> "DatasetConfig":
        dirs = [dataclasses.replace(d, path=str(self.directory_path(d).resolve())) for d in self.directory]
        return replace(self, directory=dirs)

    def directory_path(self, d: DirectoryConfig) -> Path:
        return self._relative(d.path)

    def control_path(self, d: DirectoryConfig) -> Path | None:
        return None if d.control_path is None else self._relative(d.control_path)

    def _relative(self, path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() or self._base is None else (self._base / p)


@dataclass
class TextEncoderConfig:
    """diffusion-pipe's table form of a text encoder entry: {path = ...} or {paths = [...]}, with a type."""
    path: Optional[str] = None
    paths: Optional[list[str]] = None
    type: Optional[str] = None

    def validate(self, file):
        if (self.path is None) == (self.paths is None):
            raise ConfigError("give exactly one of path or paths", file=file, key="model.text_encoders")


# ComfyUI CLIPType names (lower case) a text-encoder table may give, per model type
TEXT_ENCODER_TYPES = {"flux": ("flux",), "sdxl": ("sdxl", "stable_diffusion"), "sd3": ("sd3",),
                      "chroma": ("chroma", "pixart"), "wan": ("wan",), "wan22_5b": ("wan",), "wan22_5b_i2v": ("wan",),
                      "wan_i2v": ("wan",), "flux2": ("flux2",), "auraflow": ("auraflow", "stable_diffusion")}


def comfy_clip_type(model_type: str) -> tuple[str, ...]:
    """diffusion-pipe's ComfyUI-based models name a text encoder's ``type`` by ComfyUI's CLIPType."""
    from .models.registry import ADAPTERS, arch_spec
    return (arch_spec(model_type).clip_type.lower(),) if model_type in ADAPTERS else ()


@dataclass
class ModelConfig:
    type: str
    diffusion_model: str
    vae: str
    # file paths; diffusion-pipe's [{path|paths, type}] tables are accepted and flattened into paths
    text_encoders: list[Union[str, TextEncoderConfig]] = field(default_factory=list)
    dtype: Dtype = "bfloat16"
    diffusion_model_dtype: Optional[WeightDtype] = None
    timestep_sample_method: Literal["logit_normal", "uniform"] = "logit_normal"
    sigmoid_scale: float = 1.0
    shift: Optional[float] = None
    flux_shift: bool = False
    guidance: float = 1.0
    v_pred: bool = False
    min_t: float = 0.0                  # Wan: training timesteps restricted to [min_t, max_t] (Wan 2.2 experts)
    max_t: float = 1.0
    clip_vision: Optional[str] = None   # Wan 2.1 i2v: the CLIP-vision file (clip_vision_h.safetensors)
    merge_adapters: list[str] = field(default_factory=list)   # LoRAs merged into the base weights before training

    UNSUPPORTED = compat.MODEL
    preprocess = classmethod(lambda cls, data, file, prefix: compat.preprocess_model(data, file, prefix))

    def validate(self, file):
        from .models.registry import adapter_class, unavailable_reason

        reason = unavailable_reason(self.type)  # unknown, or needs a newer ComfyUI (named in the message)
        if reason:
            raise ConfigError(reason, file=file, key="model.type")
        if not 0.0 <= self.min_t < self.max_t <= 1.0:
            raise ConfigError(f"got min_t = {self.min_t}, max_t = {self.max_t}; need 0 <= min_t < max_t <= 1 "
                              "(Wan 2.2 14B: high-noise expert min_t = 0.875, low-noise max_t = 0.875 for t2v, "
                              "0.9 for i2v)", file=file, key="model.min_t")
        if (self.min_t, self.max_t) != (0.0, 1.0) and not adapter_class(self.type).timestep_range:
            raise ConfigError(f"a {self.type} model trains on every timestep; min_t and max_t are for Wan models "
                              "(remove them)", file=file, key="model.min_t")
        if self.clip_vision is not None and not adapter_class(self.type).takes_clip_vision:
            raise ConfigError(f"a {self.type} model takes no CLIP-vision file (Wan 2.1 i2v does); remove the key",
                              file=file, key="model.clip_vision")
        paths = []
        for i, te in enumerate(self.text_encoders):
            if isinstance(te, str):
                paths.append(te)
                continue
            allowed = TEXT_ENCODER_TYPES.get(self.type) or comfy_clip_type(self.type)
            if te.type is not None and allowed and te.type.lower() not in allowed:
                raise ConfigError(f"got type = {te.type!r}; a {self.type} model takes text encoders of type "
                                  f"{' or '.join(repr(a) for a in allowed)}", file=file,
                                  key=f"model.text_encoders[{i}]")
            paths += [te.path] if te.path is not None else list(te.paths)
        self.text_encoders = paths

    def file_paths(self) -> list[tuple[str, str]]:
        """(key, path) of every model file."""
        return [("model.diffusion_model", self.diffusion_model), ("model.vae", self.vae)] + [
            (f"model.text_encoders[{i}]", p) for i, p in enumerate(self.text_encoders)] + (
            [("model.clip_vision", self.clip_vision)] if self.clip_vision else []) + [
            (f"model.merge_adapters[{i}]", p) for i, p in enumerate(self.merge_adapters)]


@dataclass
class AdapterConfig:
    """``[adapter]``: a LoRA or LoKr on the model's linears. No ``[adapter]`` table means a full fine-tune."""
    type: Literal["lora", "lokr"] = "lora"
    rank: int = 16
    alpha: Optional[float] = None       # diffusion-pipe forbids it (alpha = rank); allowed here, default rank
    dropout: float = 0.0
    dtype: Optional[Dtype] = None       # LoRA weight dtype; default float32 (diffusion-pipe: the model dtype)
    target_modules: Optional[list[str]] = None
    init_from_existing: Optional[str] = None   # a LoRA .safetensors, or a folder holding adapter_model.safetensors
    decompose_factor: int = -1          # lokr: Kronecker factor size (-1: as square as possible)

    UNSUPPORTED = compat.ADAPTER
    preprocess = classmethod(lambda cls, data, file, prefix: compat.preprocess_adapter(data, file, prefix))

    def validate(self, file):
        if self.rank < 1:
            raise ConfigError(f"got {self.rank}; must be 1 or more", file=file, key="adapter.rank")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"got {self.dropout}; must be in [0, 1)", file=file, key="adapter.dropout")
        if self.decompose_factor == 0 or self.decompose_factor < -1:
            raise ConfigError(f"got {self.decompose_factor}; give a factor of 1 or more, or -1", file=file,
                              key="adapter.decompose_factor")
        if self.decompose_factor != -1 and self.type != "lokr":
            raise ConfigError("a LoKr option: set type = 'lokr' or remove it", file=file,
                              key="adapter.decompose_factor")

    @property
    def scale(self) -> float:
        return (self.alpha if self.alpha is not None else self.rank) / self.rank


@dataclass
class OptimizerConfig:
    """As in diffusion-pipe, every key but ``type`` goes to the optimizer's constructor (keys left out take
    the constructor's defaults). ``type``: adamw | adamw8bit | adamw_optimi | stableadamw | sgd (any case),
    or the name of any ``pytorch_optimizer`` class (e.g. Prodigy). See ``backend/optim.py``."""
    type: str = "adamw"
    lr: Optional[float] = None
    betas: Optional[list[float]] = None
    weight_decay: Optional[float] = None
    eps: Optional[float] = None
    beta2_half_life: Optional[float] = None    # sets betas[1] = 0.5 ** (global batch / half-life)
    _extra: dict = field(default_factory=dict)  # the other keys, passed to the constructor as they are

    EXTRA_KEYS = True
    UNSUPPORTED = compat.OPTIMIZER

    def validate(self, file):
        if self.lr is not None and self.lr <= 0:
            raise ConfigError(f"got {self.lr}; must be > 0", file=file, key="optimizer.lr")
        if self.betas is not None and len(self.betas) != 2:
            raise ConfigError(f"got {self.betas}; expected two numbers", file=file, key="optimizer.betas")
        if self.beta2_half_life is not None and (self.beta2_half_life <= 0 or not self.betas):
            raise ConfigError("must be > 0 and needs betas", file=file, key="optimizer.beta2_half_life")
        reason = compat.OPTIMIZER_NOT_SUPPORTED.get(self.type.lower())
        if reason:
            raise ConfigError(f"got {self.type!r}; not supported by PipeTrain: {reason}", file=file,
                              key="optimizer.type")

    def kwargs(self) -> dict:
        """Constructor keyword arguments: the keys the config sets, extras included."""
        out = {k: getattr(self, k) for k in ("lr", "betas", "weight_decay", "eps") if getattr(self, k) is not None}
        if "betas" in out:
            out["betas"] = tuple(out["betas"])
        return {**out, **self._extra}


@dataclass
class SamplesConfig:
    """Images rendered with ComfyUI's own sampler and each freshly saved epoch LoRA."""
    prompts: list[str]
    negative_prompt: str = ""
    seed: int = 0
    width: int = 1024
    height: int = 1024
    steps: int = 20
    cfg: float = 1.0
    guidance: float = 3.5                 # Flux-dev's distilled guidance input
    sampler: str = "euler"
    scheduler: str = "simple"
    # "run": the run's global rank 0 renders them in a child process; "host": the ComfyUI that started the run
    # renders them on its own queue (its model management shares the GPU), the run waits for them
    render: Literal["run", "host"] = "run"
    host_timeout_s: float = 900.0        # render = "host": how long the run waits; then it renders them itself

    def validate(self, file):
        if self.host_timeout_s <= 0:
            raise ConfigError(f"got {self.host_timeout_s}; must be > 0", file=file, key="samples.host_timeout_s")
        if not self.prompts:
            raise ConfigError("give at least one prompt (or leave [samples] out)", file=file, key="samples.prompts")
        if self.width % 16 or self.height % 16 or min(self.width, self.height) < 16:
            raise ConfigError(f"got {self.width}x{self.height}; width and height must be multiples of 16",
                              file=file, key="samples.width")
        if self.steps < 1:
            raise ConfigError("must be 1 or more", file=file, key="samples.steps")


@dataclass
class ClusterConfig:
    """Several machines through DeepSpeed's own launcher."""
    launcher: Literal["pdsh", "no_ssh", "slurm", "openmpi"] = "pdsh"
    hostfile: Optional[str] = None              # DeepSpeed hostfile: "<host> slots=<gpus>" per line
    hosts: Optional[list[str]] = None           # or "host:slots" entries (written to <run dir>/hostfile)
    master_addr: Optional[str] = None
    master_port: int = 29500
    env: dict = field(default_factory=dict)     # forwarded to every node (DeepSpeed's .deepspeed_env)
    nccl_socket_ifname: Optional[str] = None
    nccl_ib_disable: Optional[bool] = None
    nccl_p2p_disable: Optional[bool] = None

    def validate(self, file):
        if (self.hostfile is None) == (self.hosts is None):
            raise ConfigError("give exactly one of hostfile or hosts", file=file, key="cluster.hostfile")
        for h in self.hosts or []:
            name, _, slots = h.partition(":")
            if not name or not slots.isdigit() or int(slots) < 1:
                raise ConfigError(f"got {h!r}; expected 'host:slots', e.g. 'node-a:8'", file=file, key="cluster.hosts")
        if self.launcher == "no_ssh" and not self.master_addr:
            raise ConfigError("launcher = 'no_ssh' needs master_addr (the address of node 0)", file=file,
                              key="cluster.master_addr")
        for k, v in self.env.items():
            if not isinstance(v, (str, int, float, bool)):
                raise ConfigError(f"got {v!r}; values must be strings or numbers", file=file, key=f"cluster.env.{k}")


@dataclass
class EvalDatasetConfig:
    name: str      # TensorBoard tags eval/<name>/...
    config: str    # a dataset TOML, relative to the run config


@dataclass
class RunConfig:
    output_dir: str
    dataset: str
    model: ModelConfig
    epochs: int = 1
    max_steps: Optional[int] = None
    micro_batch_size_per_gpu: int = 1
    pipeline_stages: int = 1
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 1.0
    warmup_steps: int = 0
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    save_every_n_epochs: Optional[int] = 1      # diffusion-pipe has no default (one save_every_* is required)
    save_every_n_steps: Optional[int] = None
    save_every_n_examples: Optional[int] = None  # converted to steps: // global batch size
    eval_datasets: list[Union[str, EvalDatasetConfig]] = field(default_factory=list)  # a bare path: eval<i>
    eval_every_n_epochs: Optional[int] = None
    eval_every_n_steps: Optional[int] = None
    eval_every_n_examples: Optional[int] = None
    eval_before_first_step: bool = True
    eval_micro_batch_size_per_gpu: Optional[int] = None   # default micro_batch_size_per_gpu
    eval_gradient_accumulation_steps: int = 1
    uncond_fraction: float = 0.0                 # caption dropout: train with the empty caption this often
    checkpoint_every_n_epochs: Optional[int] = None
    checkpoint_every_n_minutes: Optional[float] = None
    # 'unsloth': inputs parked in CPU memory; 'selective': attention and MLP down-projection outputs kept
    activation_checkpointing: Union[bool, Literal["unsloth", "selective"]] = False
    activation_checkpointing_fraction: float = 1.0   # the share of blocks checkpointed (evenly spread)
    blocks_to_swap: int = 0                      # per stage: frozen block weights kept in CPU memory (swap.py)
    compile: bool = False                        # torch.compile each transformer block (compiled once, reused)
    activation_memory_budget: Optional[float] = None   # with compile: share of activations kept (compiling.py)
    compile_cuda_graphs: bool = True             # with compile: replay regions as CUDA graphs where it pays (SDXL)
    partition_method: Literal["parameters", "uniform", "compute", "manual"] = "compute"
    partition_split: Optional[list[int]] = None
    save_dtype: Optional[Dtype] = None
    caching_batch_size: int = 1
    steps_per_print: int = 1
    seed: int = 42
    lora_dir: Optional[str] = None
    run_name: Optional[str] = None
    adapter: Optional[AdapterConfig] = None      # no [adapter] table: full fine-tune (diffusion-pipe's meaning)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    cluster: Optional[ClusterConfig] = None
    samples: Optional[SamplesConfig] = None
    # loaded from `dataset`; not written back into run.toml
    _dataset: Optional[DatasetConfig] = None
    _file: Optional[Path] = None

    UNSUPPORTED = compat.RUN
    preprocess = classmethod(lambda cls, data, file, prefix: compat.preprocess_run(data, file, prefix))

    def validate(self, file):
        for key in ("epochs", "micro_batch_size_per_gpu", "pipeline_stages", "gradient_accumulation_steps",
                    "caching_batch_size", "steps_per_print", "eval_gradient_accumulation_steps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"got {getattr(self, key)}; must be 1 or more", file=file, key=key)
        for key in ("save_every_n_epochs", "save_every_n_steps", "save_every_n_examples", "checkpoint_every_n_epochs",
                    "max_steps", "eval_every_n_epochs", "eval_every_n_steps", "eval_every_n_examples",
                    "eval_micro_batch_size_per_gpu"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"got {value}; must be 1 or more (or leave it out)", file=file, key=key)
        if not 0 <= self.uncond_fraction < 1:
            raise ConfigError(f"got {self.uncond_fraction}; must be in [0, 1)", file=file, key="uncond_fraction")
        self.eval_datasets = [EvalDatasetConfig(f"eval{i}", e) if isinstance(e, str) else e
                              for i, e in enumerate(self.eval_datasets)]
        names = [e.name for e in self.eval_datasets]
        if len(set(names)) != len(names):
            raise ConfigError(f"got names {names}; each eval dataset needs its own name", file=file,
                              key="eval_datasets")
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
        if self.blocks_to_swap < 0:
            raise ConfigError(f"got {self.blocks_to_swap}; must be 0 or more", file=file, key="blocks_to_swap")
        if self.blocks_to_swap and self.adapter is None:
            raise ConfigError("block swapping keeps frozen weights in CPU memory, and a full fine-tune (no [adapter] "
                              "table) trains them all; set blocks_to_swap = 0, or train an adapter", file=file,
                              key="blocks_to_swap")
        if self.partition_method == "manual":
            if not self.partition_split or len(self.partition_split) != self.pipeline_stages - 1:
                raise ConfigError(
                    f"partition_method = 'manual' needs partition_split with {self.pipeline_stages - 1} layer indices",
                    file=file, key="partition_split")

    # --- derived ---------------------------------------------------------------------------
    @property
    def dataset_config(self) -> DatasetConfig:
        if self._dataset is None:
            self._dataset = load_dataset_config(self.resolve(self.dataset))
        return self._dataset

    def eval_dataset_configs(self) -> dict[str, DatasetConfig]:
        return {e.name: load_dataset_config(self.resolve(e.config)) for e in self.eval_datasets}

    def check_model_paths(self) -> None:
        """A model path that is a folder (a diffusers checkpoint?) fails here, naming the key."""
        for key, path in self.model.file_paths():
            if self.resolve(path).is_dir():
                raise ConfigError(f"{self.resolve(path)} is a folder (a diffusers model?). {compat.SINGLE_FILES_HINT}",
                                  file=self._file, key=key)

    def resolve(self, path: str | Path) -> Path:
        """Resolve a path from this config relative to the TOML file it came from."""
        p = Path(path).expanduser()
        if p.is_absolute() or self._file is None:
            return p
        return (self._file.parent / p).resolve()

    def with_absolute_paths(self) -> "RunConfig":
        """A copy whose file paths no longer depend on where the TOML lives (for copies in run folders)."""
        r = self.resolve
        model = dataclasses.replace(self.model, diffusion_model=str(r(self.model.diffusion_model)),
                                    vae=str(r(self.model.vae)),
                                    text_encoders=[str(r(p)) for p in self.model.text_encoders])
        adapter = self.adapter
        if adapter is not None and adapter.init_from_existing:
            adapter = dataclasses.replace(adapter, init_from_existing=str(r(adapter.init_from_existing)))
        evals = [dataclasses.replace(e, config=str(r(e.config))) for e in self.eval_datasets]
        cluster = self.cluster
        if cluster is not None and cluster.hostfile:
            cluster = dataclasses.replace(cluster, hostfile=str(r(cluster.hostfile)))
        return replace(self, output_dir=str(r(self.output_dir)), dataset=str(r(self.dataset)), model=model,
                       adapter=adapter, cluster=cluster, eval_datasets=evals,
                       lora_dir=str(r(self.lora_dir)) if self.lora_dir else None)

    def check_world_size(self, world_size: int) -> None:
        if world_size % self.pipeline_stages:
            raise ConfigError(
                f"pipeline_stages={self.pipeline_stages} does not divide the {world_size} ranks; "
                f"use a number of GPUs that is a multiple of {self.pipeline_stages}",
                file=self._file, key="pipeline_stages")


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("file not found", file=path) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"not valid TOML: {e}", file=path) from None


def load_dataset_config(path: str | Path) -> DatasetConfig:
    path = Path(path).resolve()
    cfg = from_dict(DatasetConfig, _read_toml(path), file=path)
    cfg._base = path.parent
    return cfg


def load_run_config(path: str | Path, *, check_dataset: bool = True) -> RunConfig:
    path = Path(path).resolve()
    cfg = from_dict(RunConfig, _read_toml(path), file=path)
    cfg._file = path
    cfg.check_model_paths()
    if check_dataset:
        cfg.dataset_config  # noqa: B018  (fail early on a bad dataset file)
        cfg.eval_dataset_configs()
    return cfg


def save_toml(obj, path: str | Path) -> None:
    """Write a config dataclass to TOML atomically."""
    from .fsutil import atomic_write_bytes

    atomic_write_bytes(Path(path), tomli_w.dumps(to_dict(obj)).encode())


def replace(cfg, **changes):
    new = dataclasses.replace(cfg, **changes)
    for name in ("_dataset", "_file", "_base"):
        if hasattr(cfg, name):
            setattr(new, name, getattr(cfg, name))
    return new
