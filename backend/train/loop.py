"""The training loop: steps, reporting, evals, epoch and step LoRAs, checkpoints, graceful stop."""
from __future__ import annotations

import logging
import time

import torch

from ..optim import prodigy_d
from . import distributed
from .control import ControlFlags
from .eval import eval_due, evaluate
from .profiling import StepProfiler
from .reporting import FinishedStep, StepReports, pending_step, timing_event

log = logging.getLogger("pipetrain")


def _progress_bar(trainer):
    if trainer.rank != 0 or not trainer.opts.progress:
        return None
    from tqdm import tqdm
    return tqdm(total=trainer.total_steps, initial=trainer.global_step, unit="step", dynamic_ncols=True)


def _requests(trainer) -> tuple[bool, bool]:
    """(checkpoint, stop) as rank 0 sees them now: a stop checkpoints too."""
    if trainer.rank != 0:
        return False, False
    stop = trainer.stop_requested or (trainer.run_dir / "stop").exists()
    minutes = trainer.cfg.checkpoint_every_n_minutes
    due = minutes is not None and time.monotonic() - trainer.last_checkpoint_time >= minutes * 60
    return due or stop, stop


def _report_step(trainer, s: FinishedStep, started: float, bar) -> None:
    """``s.lr``: the learning rate the step used (read before the step; the schedule has moved on since)."""
    cfg = trainer.cfg
    samples_per_s = cfg.micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * trainer.dp_world / s.step_time
    elapsed = time.monotonic() - started
    eta = elapsed / s.steps_done * (trainer.total_steps - s.step)
    extra, scalars = {}, {"train/loss": s.loss, "train/lr": s.lr, "train/samples_per_s": samples_per_s}
    if torch.cuda.is_available():
        extra["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    if s.grad_norm is not None:
        extra["grad_norm"] = scalars["train/grad_norm"] = s.grad_norm
    if s.prodigy_d is not None:
        extra["prodigy_d"] = scalars["train/prodigy_d"] = s.prodigy_d
    trainer.reporter.event("step", step=s.step, epoch=s.epoch, loss=s.loss, lr=s.lr, samples_per_s=samples_per_s,
                           step_time_s=s.step_time, total_steps=trainer.total_steps, **extra)
    trainer.reporter.update(state="training", step=s.step, total_steps=trainer.total_steps, epoch=s.epoch,
                            epochs=cfg.epochs, loss=s.loss, lr=s.lr, samples_per_s=samples_per_s, eta_s=eta)
    trainer.reporter.scalars(s.step, **scalars)
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{s.loss:.4f}", epoch=s.epoch)


def _end_of_epoch(trainer, epoch: int) -> None:
    cfg = trainer.cfg
    trainer.reporter.event("epoch", epoch=epoch, step=trainer.global_step)
    if cfg.save_every_n_epochs and epoch % cfg.save_every_n_epochs == 0:
        path = trainer.save_lora(epoch)
        trainer.last_saved_epoch = epoch
        trainer.render_samples(path, epoch)
    if cfg.checkpoint_every_n_epochs and epoch % cfg.checkpoint_every_n_epochs == 0:
        trainer.save_checkpoint()


def run_loop(trainer) -> None:
    engine, plan = trainer.engine, trainer.plan
    steps_per_epoch = plan.steps_per_epoch()
    trainer.last_checkpoint_time = time.monotonic()
    trainer.last_saved_epoch = None
    if trainer.global_step == 0 and trainer.cfg.eval_before_first_step:
        evaluate(trainer)
    bar = _progress_bar(trainer)
    started = time.monotonic()
    reports = StepReports(lambda s: _report_step(trainer, s, started, bar), started, timing_event())   # rank 0 feeds it
    batches, batches_epoch = None, None
    reads_data = engine.is_first_stage() or engine.is_last_stage()   # middle stages never pull the feed
    profiler = StepProfiler.from_env(trainer.rank)
    control = ControlFlags(trainer.world, distributed.device())
    while trainer.global_step < trainer.total_steps:
        if batches_epoch != trainer.epoch:
            batches, batches_epoch = plan.epoch(trainer.epoch), trainer.epoch
        lr = engine.get_lr()[0]
        engine.reset_activation_shape()
        torch.compiler.cudagraph_mark_step_begin()   # CUDA-graphed blocks: the last step's outputs are done with
        if profiler:
            profiler.before_step(trainer.global_step + 1)
        loss = engine.train_batch(trainer.feed.step_iter(batches[trainer.step_in_epoch], trainer.epoch,
                                                         trainer.step_in_epoch))
        following = trainer.step_in_epoch + 1
        if reads_data and following < steps_per_epoch and trainer.global_step + 1 < trainer.total_steps:
            trainer.feed.prefetch(batches[following], trainer.epoch, following)
        trainer.global_step += 1
        trainer.step_in_epoch += 1
        if profiler and (summary := profiler.after_step(trainer.global_step)):
            trainer.reporter.event("profile", folder=str(profiler.folder), **summary)
        if trainer.rank == 0:
            # global_step counts this step now; issuing it reports the step before
            reports.issued(pending_step(trainer.global_step, trainer.epoch, lr, loss, trainer.grad_norm,
                                        prodigy_d(engine.optimizer)))
        if trainer.save_every_steps and trainer.global_step % trainer.save_every_steps == 0:
            reports.flush()
            trainer.save_lora(trainer.epoch, at_step=True)
        finished_epoch = None
        if trainer.step_in_epoch == steps_per_epoch:
            trainer.step_in_epoch = 0
            trainer.epoch += 1
            finished_epoch = trainer.epoch - 1
            reports.flush()
            _end_of_epoch(trainer, finished_epoch)
        if eval_due(trainer, finished_epoch):
            reports.flush()
            evaluate(trainer)
        checkpoint_now, stop_now = control.exchange(*_requests(trainer))
        if checkpoint_now:
            reports.flush()
            trainer.save_checkpoint()
        if stop_now:
            _stopped(trainer, bar)
            return
    reports.flush()
    _finished(trainer, bar)


def _stopped(trainer, bar) -> None:
    if bar is not None:
        bar.close()
    if trainer.rank == 0:
        (trainer.run_dir / "stop").unlink(missing_ok=True)
        trainer.reporter.event("stopped", step=trainer.global_step, epoch=trainer.epoch)
        trainer.reporter.update(state="stopped")
    log.info("stopped at step %d after a checkpoint; resume with --resume %s", trainer.global_step, trainer.run_dir.name)


def _finished(trainer, bar) -> None:
    if bar is not None:
        bar.close()
    last_epoch = trainer.epoch - 1 if trainer.step_in_epoch == 0 else trainer.epoch
    if trainer.last_saved_epoch != last_epoch and trainer.global_step > 0:
        path = trainer.save_lora(last_epoch)
        trainer.render_samples(path, last_epoch)
    trainer.save_checkpoint()
    if trainer.rank == 0:
        (trainer.run_dir / "stop").unlink(missing_ok=True)   # asked for too late: the run had finished
        trainer.reporter.event("done", step=trainer.global_step, epoch=last_epoch)
        trainer.reporter.update(state="finished")
