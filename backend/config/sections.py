"""``[optimizer]``, ``[samples]``, ``[cluster]`` and ``[[eval_datasets]]``: the run's smaller sections."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional

from . import compat
from ..errors import ConfigError
from .patch import widget
from .schema import secret
from .process_inputs import (control_problem, env_name_problem, env_value_problem, host_problem, ifname_problem, refuse,
    shown)


@dataclass
class OptimizerConfig:
    """As in diffusion-pipe, every key but ``type`` goes to the optimizer's constructor (keys left out take
    the constructor's defaults). ``type``: adamw | adamw8bit | adamw_optimi | stableadamw | sgd (any case),
    or the name of any ``pytorch_optimizer`` class (e.g. Prodigy). See ``backend/optim/registry.py``."""
    type: str = "adamw"
    # left out: the constructor's default (optimi's AdamW has none for lr); the widgets start at the values named
    lr: Optional[float] = field(default=None, metadata=widget(2e-4))
    betas: Optional[list[float]] = field(default=None, metadata=widget([0.9, 0.99]))
    weight_decay: Optional[float] = field(default=None, metadata=widget(0.01))
    eps: Optional[float] = field(default=None, metadata=widget(1e-8))
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


MAX_STRENGTHS = 6
MAX_SAMPLE_FRAMES = 1024
MAX_SAMPLE_SECONDS = 1000.0   # EmptyAceStepLatentAudio's largest
_WANDB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass
class MonitoringConfig:
    """diffusion-pipe's ``[monitoring]``: Weights & Biases beside TensorBoard (global rank 0 logs the same scalars)."""
    enable_wandb: bool = False
    # else wandb's own login (``wandb login``, WANDB_API_KEY); never written back (a resumed run, which reads the
    # run folder's run.toml, logs in that way)
    wandb_api_key: Optional[str] = field(default=None, metadata=secret())
    wandb_tracker_name: Optional[str] = None  # the W&B project (default "pipetrain")
    wandb_run_name: Optional[str] = None      # default: the run id

    def validate(self, file):
        for key in ("wandb_tracker_name", "wandb_run_name"):
            value = getattr(self, key)
            if value and not _WANDB_NAME.match(value):   # '' (diffusion-pipe's examples): the default
                raise ConfigError("use letters, digits, '.', '-' and '_' (at most 128)", file=file,
                                  key=f"monitoring.{key}")
        if self.wandb_api_key and not re.fullmatch(r"[A-Za-z0-9_-]{8,128}", self.wandb_api_key):
            raise ConfigError("not a W&B API key (letters and digits); the value is not shown", file=file,
                              key="monitoring.wandb_api_key")


SAMPLE_FILES = ("start_image", "end_image", "control_video")   # [samples] keys naming a file relative to the run config


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
    # each prompt at each LoRA strength (the panel shows epoch x strength x prompt); a full fine-tune: [1.0]
    strengths: list[float] = field(default_factory=lambda: [1.0])
    # video models: each sample is a clip of this many frames (4k + 1 for Wan / HunyuanVideo, 8k + 1 for LTX-Video /
    # Cosmos: 17 is both), saved as an animated WebP at fps (None: the model's frame rate); image models: a still
    frames: int = 17
    fps: Optional[float] = None
    # image-to-video models: the image the clips start from (relative to this file); None: the first frame of the
    # dataset's first clip (wan_flf2v: its first and last frames)
    start_image: Optional[str] = None
    # wan_flf2v: the image the clips end on (relative to this file); None: the start image's clip's last frame
    # (with start_image: the end left free)
    end_image: Optional[str] = None
    # control-video models (wan_vace, wan_fun_control): the control video (or image) the clips render with, in place
    # of the dataset's first control clip (relative to this file)
    control_video: Optional[str] = None
    # audio models (ACE-Step): each sample is a song this many seconds long (as EmptyAceStepLatentAudio's seconds),
    # the prompts are its tags and ``lyrics`` its lyrics (every prompt the same; empty: instrumental)
    seconds: float = 30.0
    lyrics: str = ""

    def validate(self, file):
        if not 1 <= self.seconds <= MAX_SAMPLE_SECONDS:
            raise ConfigError(f"got {self.seconds}; a song of 1 to {MAX_SAMPLE_SECONDS} seconds, e.g. 30", file=file,
                              key="samples.seconds")
        if self.host_timeout_s <= 0:
            raise ConfigError(f"got {self.host_timeout_s}; must be > 0", file=file, key="samples.host_timeout_s")
        if not self.prompts:
            raise ConfigError("give at least one prompt (or leave [samples] out)", file=file, key="samples.prompts")
        if self.width % 16 or self.height % 16 or min(self.width, self.height) < 16:
            raise ConfigError(f"got {self.width}x{self.height}; width and height must be multiples of 16",
                              file=file, key="samples.width")
        if self.steps < 1:
            raise ConfigError("must be 1 or more", file=file, key="samples.steps")
        # 0 renders the base model (the LoRA off): the row the others compare with
        if not 1 <= len(self.strengths) <= MAX_STRENGTHS or any(not 0 <= x <= 2 for x in self.strengths):
            raise ConfigError(f"got {self.strengths}; give 1 to {MAX_STRENGTHS} LoRA strengths, each from 0 (the "
                              "base model) to 2, e.g. [0, 0.8, 1.0]", file=file, key="samples.strengths")
        if len(set(self.strengths)) != len(self.strengths):
            raise ConfigError(f"got {self.strengths}; each strength once", file=file, key="samples.strengths")
        if not 1 <= self.frames <= MAX_SAMPLE_FRAMES:
            raise ConfigError(f"got {self.frames}; a clip of 1 to {MAX_SAMPLE_FRAMES} frames, e.g. 17",
                              file=file, key="samples.frames")
        if self.fps is not None and not 0 < self.fps <= 240:
            raise ConfigError(f"got {self.fps}; frames per second above 0 and at most 240 (or leave it out: the "
                              "model's frame rate)", file=file, key="samples.fps")


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
            if not name or not re.fullmatch(r"[0-9]{1,4}", slots) or int(slots) < 1:
                raise ConfigError(f"entry {shown(h)}: expected 'host:slots', e.g. 'node-a:8'", file=file,
                                  key="cluster.hosts")
            refuse(host_problem(name), f"host {shown(name)}", file, "cluster.hosts")
        if self.hostfile is not None:
            refuse(control_problem(self.hostfile), "the path", file, "cluster.hostfile")
        if self.launcher == "no_ssh" and not self.master_addr:
            raise ConfigError("launcher = 'no_ssh' needs master_addr (the address of node 0)", file=file,
                              key="cluster.master_addr")
        if self.master_addr is not None:
            refuse(host_problem(self.master_addr), f"{shown(self.master_addr)}", file, "cluster.master_addr")
        if not 1 <= self.master_port <= 65535:
            raise ConfigError(f"got {self.master_port}; a TCP port, 1 to 65535", file=file, key="cluster.master_port")
        if self.nccl_socket_ifname is not None:
            refuse(ifname_problem(self.nccl_socket_ifname), shown(self.nccl_socket_ifname), file,
                    "cluster.nccl_socket_ifname")
        for k, v in self.env.items():
            refuse(env_name_problem(k), f"the name {shown(k)}", file, "cluster.env")
            if not isinstance(v, (str, int, float, bool)):
                raise ConfigError("values must be strings or numbers", file=file, key=f"cluster.env.{k}")
            refuse(env_value_problem(str(v)), "the value", file, f"cluster.env.{k}")


@dataclass
class EvalDatasetConfig:
    name: str      # TensorBoard tags eval/<name>/...
    config: str    # a dataset TOML, relative to the run config

