"""Held-out loss on the eval datasets (diffusion-pipe's eval, deterministic).

Each eval dataset is run once per timestep quantile in 0.1 .. 0.9: every sample at the timestep
``objective.quantile_t(q)`` (the q-quantile of the training distribution, shift included), through
``engine.eval_batch`` (no_grad, LoRA dropout off). The loss per quantile and their mean are reported.
The noise of a sample is a pure function of (seed, its latent and caption keys): the same weights
always give the same eval loss, whatever the pipeline / data-parallel layout and whenever it runs, so
changes between evaluations are the training's alone. Training's RNG state is left untouched.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import torch

from ..config import RunConfig
from ..data import EpochPlan
from ..data.epoch_plan import eval_batches_by_resolution
from ..errors import DatasetError
from ..fsutil import fault_point
from . import distributed
from .events import RunReporter
from .feed import MicroBatchFeed
from .parts import CachedData, RunState, Topology

log = logging.getLogger("pipetrain")

TIMESTEP_QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


class EvalFeed(MicroBatchFeed):
    """Cached eval samples at one fixed timestep quantile, with per-sample seeded noise and no caption dropout."""
    quantile = 0.5

    def _text_key(self, entry, epoch, step, position):
        return entry.text

    def _seed(self, epoch, step, position, entry):
        digest = hashlib.sha256(f"pipetrain-eval:{self.seed}:{entry.latent}:{entry.text}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    def _noise_and_t(self, latent, epoch, step, position, entry=None):
        g = torch.Generator().manual_seed(self._seed(epoch, step, position, entry))
        noise = torch.randn(latent.shape, generator=g)
        return noise, self.objective.quantile_t(self.quantile, self.seq_len(latent))


@dataclass
class EvalSet:
    name: str
    plan: EpochPlan
    feed: EvalFeed


def build_eval_sets(cfg: RunConfig, adapter, data: CachedData, topology: Topology,
                    reporter: RunReporter) -> list[EvalSet]:
    micro = cfg.eval_micro_batch_size_per_gpu or cfg.micro_batch_size_per_gpu
    sets = []
    configs = cfg.eval_dataset_configs()
    for name, entries in data.eval_entries.items():
        ratio = configs[name].subsample_ratio if name in configs else None   # its dataset file's share of an epoch
        try:
            plan = EpochPlan(entries, [e.num_repeats for e in entries], micro, cfg.eval_gradient_accumulation_steps,
                             topology.dp_rank, topology.dp_world, cfg.seed,
                             image_micro_batch_size=cfg.eval_image_micro_batch_size_per_gpu or micro,
                             by_resolution=eval_batches_by_resolution(cfg),
                             subsample_ratio=ratio)
        except DatasetError as e:
            raise DatasetError(f"eval dataset {name!r}: {e} (eval_micro_batch_size_per_gpu, its per-resolution "
                               "list and eval_gradient_accumulation_steps set the eval batch)") from None
        if topology.is_main:
            for message in plan.warnings():
                reporter.event("warning", message=f"eval dataset {name!r}: {message}")
                log.warning("eval dataset %r: %s", name, message)
        feed = EvalFeed(adapter, data.store, cfg.seed, topology.dp_rank, topology.dp_world,
                        device=distributed.device())
        sets.append(EvalSet(name, plan, feed))
    return sets


def every_n_steps(steps: int | None, examples: int | None, global_batch: int) -> int | None:
    """A step interval given in steps, or in examples (diffusion-pipe: // the global batch size)."""
    if steps:
        return steps
    return max(1, examples // global_batch) if examples else None


def eval_due(every_steps: int | None, every_epochs: int | None, global_step: int, finished_epoch: int | None) -> bool:
    """diffusion-pipe's rule: every eval_every_n_steps steps, or at the end of every eval_every_n_epochs-th epoch."""
    if every_steps and global_step % every_steps == 0:
        return True
    return bool(finished_epoch and every_epochs and finished_epoch % every_epochs == 0)


def _evaluate_set(engine, s: EvalSet, micro_batches: int) -> list[float]:
    batches = s.plan.epoch(0)
    losses = []
    for q in TIMESTEP_QUANTILES:
        s.feed.quantile = q
        total = 0.0
        for i, step_batches in enumerate(batches):
            engine.reset_activation_shape()
            loss = engine.eval_batch(s.feed.step_iter(step_batches, 0, i), num_micro_batches=micro_batches)
            total += float(loss.item()) if torch.is_tensor(loss) else float(loss)
            fault_point("eval-batch")
        losses.append(total / len(batches))
    return losses


def evaluate(sets: list[EvalSet], engine, micro_batches: int, state: RunState, topology: Topology,
             reporter: RunReporter) -> None:
    """Evaluate every eval dataset now (all ranks; ``micro_batches``: eval_gradient_accumulation_steps); rank 0
    reports."""
    if not sets:
        return
    started = time.monotonic()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    results = {}
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for s in sets:
            results[s.name] = _evaluate_set(engine, s, micro_batches)
    if not topology.is_main:
        return
    seconds = time.monotonic() - started
    step = state.global_step
    epoch = state.epoch - 1 if state.step_in_epoch == 0 and step > 0 else state.epoch   # the step's epoch
    for name, losses in results.items():
        mean = sum(losses) / len(losses)
        per_q = {f"{q:.2f}": loss for q, loss in zip(TIMESTEP_QUANTILES, losses)}
        reporter.event("eval", name=name, step=step, epoch=epoch, loss=mean, quantiles=per_q)
        reporter.scalars(step, **{f"eval/{name}/loss": mean},
                                 **{f"eval/{name}/loss_quantile_{q}": v for q, v in per_q.items()})
        log.info("eval %s at step %d: loss %.5f", name, step, mean)
    reporter.scalars(step, **{"eval/eval_time_sec": seconds})
    evals = dict(reporter.status.get("eval", {}))
    evals.update({name: {"step": step, "loss": sum(v) / len(v)} for name, v in results.items()})
    reporter.update(eval=evals)
