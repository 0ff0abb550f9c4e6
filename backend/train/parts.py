"""The parts a run is made of, each returned by one phase of the trainer (``trainer.py``): where this rank
sits (``Topology``, from ``setup_distributed``), the cached data (``CachedData``, from ``caching.prepare_cache``),
the engine and what trains with it (``EngineParts``, from ``engine.build_engine``) and the run's position
(``RunState``: the loop advances it, a checkpoint restores it). A phase takes the parts it needs and nothing
else, so each one can be built and tested alone."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..cache import CacheStore
    from ..cache.manifest import CacheEntry
    from ..data import EpochPlan
    from .ema import WeightAverage
    from .reg_loss import StepSums
    from .eval import EvalSet
    from .feed import MicroBatchFeed
    from .swap import BlockSwapper


@dataclass(frozen=True)
class Topology:
    """This process among the ranks: DeepSpeed's grid puts global rank ``stage * dp_world + dp_rank``."""
    rank: int
    world: int
    local_rank: int
    pipeline_stages: int = 1

    @property
    def dp_world(self) -> int:
        return self.world // self.pipeline_stages

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp_world

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one that reports and writes the run folder's shared files."""
        return self.rank == 0


@dataclass(frozen=True)
class CachedData:
    """What the cache phase leaves for training: every entry's latents and texts are in ``store``."""
    store: CacheStore
    entries: list[CacheEntry]                    # the train dataset's
    eval_entries: dict[str, list[CacheEntry]]    # each eval dataset's, by name
    uncond_text: dict[str, str] | None = None    # caption dropout: a caption's text key -> the empty caption's
    # diff_output_preservation: a caption's text key -> the key of the caption with the trigger word swapped
    preservation_text: dict[str, str] | None = None


@dataclass
class GradNorm:
    """The global gradient norm of the latest step (a device tensor, read when the step is reported), written by
    the clipping DeepSpeed calls; None where nothing is clipped."""
    value: torch.Tensor | None = None


@dataclass(frozen=True)
class EngineParts:
    """The DeepSpeed engine and what trains with it; fixed once built."""
    engine: object                    # deepspeed.runtime.pipe.engine.PipelineEngine
    plan: EpochPlan
    feed: MicroBatchFeed
    swapper: BlockSwapper | None
    grad_norm: GradNorm
    global_batch: int
    total_steps: int                  # of a run from its start (a resume recounts from its position)
    save_every_steps: int | None
    eval_every_steps: int | None
    eval_sets: list[EvalSet] = field(default_factory=list)
    ema: WeightAverage | None = None  # ``ema = true``: this stage's moving average of the trained weights
    # is_reg directories, diff_output_preservation: the step's loss sums per kind, which the loss functions keep
    loss_sums: StepSums | None = None
    preservation: bool = False        # diff_output_preservation: the steps run under ``lora.base_rows``


@dataclass
class RunState:
    """Where the run is: the loop advances it, a checkpoint saves and restores it."""
    global_step: int = 0
    epoch: int = 1
    step_in_epoch: int = 0
    total_steps: int = 0
    last_checkpoint_step: int | None = None   # the step the newest checkpoint holds (restored or saved)
    # the global step whose weights the newest epoch LoRA holds (kept in checkpoints): the run's end writes one
    # unless it holds this step's, so the steps a resume adds to an epoch already saved are saved too
    last_saved_step: int | None = None
    last_checkpoint_time: float = 0.0         # time.monotonic() of the newest checkpoint (or the loop's start)
    base_lr: float | None = None              # a learning rate set while the run trained (run/control.py)

    def client_state(self, global_batch: int) -> dict:
        """What a checkpoint keeps of the position (``checkpoint.save``)."""
        state = {"global_step": self.global_step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                 "global_batch": global_batch, "last_saved_step": self.last_saved_step}
        return state | ({"base_lr": self.base_lr} if self.base_lr is not None else {})

