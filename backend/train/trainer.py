"""The trainer: named phases over one run (set up ranks, run directory, cache, engine, resume, loop)."""
from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import RunConfig, save_toml
from ..models.base import DTYPES
from ..models.registry import adapter_class
from . import checkpoint, distributed
from .events import RunReporter
from .saving import gather_lora, save_full_model, write_lora

log = logging.getLogger("pipetrain")


@dataclass
class TrainOptions:
    resume: str | None = None          # "" = newest run with a checkpoint; a name or path otherwise
    regenerate_cache: bool = False
    trust_cache: bool = False
    cache_only: bool = False
    progress: bool = True


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted",
              "Broken pipe", "ProcessGroupNCCL", "Timed out")


def explain_failure(e: BaseException, run_name: str) -> str:
    text = f"{type(e).__name__}: {e}"
    if any(marker in text for marker in _PEER_LOST):
        return (f"lost contact with another rank (a node or a training process stopped): {text.splitlines()[0]}. "
                f"The run is resumable from its last checkpoint: launch it again with --resume {run_name}")
    return text


class Trainer:
    def __init__(self, cfg: RunConfig, options: TrainOptions):
        self.cfg = cfg
        self.opts = options
        self.stop_requested = False
        self.global_step = 0
        self.epoch = 1
        self.step_in_epoch = 0

    # --- phases -----------------------------------------------------------------------------
    def run(self) -> int:
        self.setup_distributed()
        self.prepare_run_dir()
        try:
            self.adapter = adapter_class(self.cfg.model.type)(self.cfg.model, self.cfg.resolve)
            self.prepare_cache()
            if self.opts.cache_only:
                self.reporter.update(state="cached")
                self.reporter.event("done", reason="cache_only")
                return 0
            if self.stop_before_training():
                return 0
            self.build_engine()
            self.restore()
            self.train_loop()
            return 0
        except BaseException as e:
            if self.rank == 0 and not isinstance(e, SystemExit):
                message = explain_failure(e, self.run_dir.name)
                self.reporter.event("error", message=message)
                self.reporter.update(state="failed", error=message)
                log.error(message)
            raise
        finally:
            self.reporter.close()

    def setup_distributed(self) -> None:
        self.rank, self.world, self.local_rank = distributed.init()
        if not self.opts.cache_only:  # caching spreads over any number of ranks
            self.cfg.check_world_size(self.world)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def prepare_run_dir(self) -> None:
        from .rundir import choose_run_dir

        run_dir = None
        if self.rank == 0:
            if self.opts.cache_only:  # caching alone makes no run; its events go beside the cache
                run_dir = self.cfg.resolve(self.cfg.output_dir) / "cache"
                run_dir.mkdir(parents=True, exist_ok=True)
            else:
                run_dir = choose_run_dir(self.cfg, self.opts.resume)
        self.run_dir = Path(distributed.broadcast_object(str(run_dir) if run_dir else None))
        self.ckpt_root = self.run_dir / "checkpoints"
        self.reporter = RunReporter(self.run_dir, enabled=self.rank == 0)
        if self.rank == 0:
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
            if not self.opts.cache_only and not (self.run_dir / "run.toml").exists():
                save_toml(self.cfg.with_absolute_paths(), self.run_dir / "run.toml")
                save_toml(self.cfg.dataset_config.with_absolute_paths(), self.run_dir / "dataset.toml")
            self.reporter.update(state="starting", run_dir=str(self.run_dir), world_size=self.world,
                                 pipeline_stages=self.cfg.pipeline_stages)
            self.reporter.event("start", world_size=self.world, pipeline_stages=self.cfg.pipeline_stages,
                                resume=self.opts.resume is not None)
        distributed.barrier()

    def prepare_cache(self) -> None:
        from .caching import prepare_cache

        self.reporter.update(state="caching")
        self.store, self.entries = prepare_cache(self)

    def build_engine(self) -> None:
        from .engine import build_engine

        self.reporter.update(state="loading")
        build_engine(self)

    def stop_before_training(self) -> bool:
        """A stop asked for while caching ends the run before the engine is built (nothing to checkpoint)."""
        stop = None
        if self.rank == 0:
            stop = self.stop_requested or (self.run_dir / "stop").exists()
        if not distributed.broadcast_object(stop):
            return False
        if self.rank == 0:
            (self.run_dir / "stop").unlink(missing_ok=True)
            self.reporter.event("stopped", step=self.global_step, epoch=self.epoch, before_training=True)
            self.reporter.update(state="stopped")
        return True

    def restore(self) -> None:
        if self.opts.resume is None:
            return
        tag = checkpoint.latest_tag(self.ckpt_root)
        if tag is None:
            if self.rank == 0:
                log.warning("no checkpoint in %s: starting from the beginning", self.run_dir)
            return
        state = checkpoint.load(self.engine, self.ckpt_root, tag)
        self.global_step = state["global_step"]
        self.epoch = state["epoch"]
        self.step_in_epoch = state["step_in_epoch"]
        saved_batch = state.get("global_batch", self.global_batch)
        if saved_batch != self.global_batch:  # another number of data-parallel ranks (e.g. more nodes)
            examples = self.step_in_epoch * saved_batch
            self.step_in_epoch = min(examples // self.global_batch, self.plan.steps_per_epoch())
            if self.rank == 0 and examples % self.global_batch:
                log.warning("resuming with a global batch of %d instead of %d: the epoch continues after %d of "
                            "its %d examples", self.global_batch, saved_batch, self.step_in_epoch * self.global_batch,
                            examples)
        remaining = (self.cfg.epochs - self.epoch + 1) * self.plan.steps_per_epoch() - self.step_in_epoch
        self.total_steps = self.global_step + remaining
        if self.cfg.max_steps:
            self.total_steps = min(self.total_steps, self.cfg.max_steps)
        if self.rank == 0:
            self.reporter.event("resume", checkpoint=tag, step=self.global_step, epoch=self.epoch,
                                global_batch=self.global_batch, saved_global_batch=saved_batch)

    def train_loop(self) -> None:
        from .loop import run_loop

        run_loop(self)

    # --- helpers used by the phases ---------------------------------------------------------
    @property
    def global_batch(self) -> int:
        c = self.cfg
        return c.micro_batch_size_per_gpu * c.gradient_accumulation_steps * self.dp_world

    def client_state(self) -> dict:
        return {"global_step": self.global_step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "global_batch": self.global_batch}

    def save_checkpoint(self) -> None:
        path = checkpoint.save(self.engine, self.ckpt_root, self.global_step, self.client_state())
        self.last_checkpoint_time = time.monotonic()
        if self.rank == 0:
            self.reporter.event("checkpoint", step=self.global_step, epoch=self.epoch, path=str(path))
            self.reporter.update(last_checkpoint=str(path))

    def save_lora(self, epoch: int, *, at_step: bool = False) -> Path | None:
        """Write the epoch LoRA, or with ``at_step`` the step LoRA (save_every_n_steps) (global rank 0);
        returns its path there, None elsewhere. A full fine-tune writes the whole model instead (saving.py)."""
        if self.cfg.adapter is None:
            return save_full_model(self, epoch, at_step)
        save_dtype = DTYPES[self.cfg.save_dtype] if self.cfg.save_dtype else torch.float32
        sd = gather_lora(self.engine.module, self.dp_rank, save_dtype)
        if self.rank != 0:
            return None
        folder = Path(self.cfg.lora_dir) if self.cfg.lora_dir else self.run_dir / "loras"
        adapter_cfg = {"type": self.cfg.adapter.type, "rank": self.cfg.adapter.rank,
                       "alpha": self.cfg.adapter.alpha or self.cfg.adapter.rank,
                       "dropout": self.cfg.adapter.dropout, "target_blocks": list(self.adapter.lora_block_prefixes),
                       "target_modules": self.cfg.adapter.target_modules, "model_type": self.cfg.model.type,
                       "decompose_factor": self.cfg.adapter.decompose_factor}
        run_toml = (self.run_dir / "run.toml").read_text()
        stem = f"{self.run_dir.name}-step{self.global_step:08d}" if at_step else f"{self.run_dir.name}-epoch{epoch:04d}"
        path = write_lora(sd, folder, stem, adapter_cfg, run_toml,
                          {"epoch": epoch, "step": self.global_step, "run": self.run_dir.name})
        if at_step:   # not an epoch LoRA: its own event, outside the epoch list
            self.reporter.event("step_lora_saved", epoch=epoch, step=self.global_step, path=str(path))
            return path
        loras = self.reporter.status.get("loras", []) + [{"epoch": epoch, "step": self.global_step, "path": str(path)}]
        self.reporter.update(loras=loras)
        self.reporter.event("lora_saved", epoch=epoch, step=self.global_step, path=str(path))
        log.info("saved epoch %d LoRA: %s", epoch, path)
        return path

    def render_samples(self, lora_path: Path | None, epoch: int) -> None:
        """Sample images with the fresh LoRA (see backend/sampling.py); every rank waits for rank 0."""
        from ..sampling import render_epoch_samples

        render_epoch_samples(self, lora_path, epoch)

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = True
