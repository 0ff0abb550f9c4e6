"""The training loop: steps, reporting, evals, epoch and step LoRAs, checkpoints, graceful stop, and the requests
from outside the run (``backend/run/control.py``): save or sample now, stop after this epoch, a new learning
rate."""
from __future__ import annotations

import logging
import signal
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from ..adapters import injection
from ..models.compiling import cuda_graphs_allowed
from ..run import control as run_control
from ..optim.registry import prodigy_d
from . import distributed, dp_layout
from .control import Control, ControlFlags
from .eval import eval_due, evaluate
from .events import RunReporter
from .memory_history import MemoryHistory
from .parts import RunState
from .preservation import PARTS
from .profiling import StepProfiler
from .reporting import FinishedStep, StepReports, pending_step, timing_event
from .schedule import set_base_lr
from .stop_signals import describe

if TYPE_CHECKING:
    from .trainer import Trainer

log = logging.getLogger("pipetrain")


def _progress_bar(shown: bool, state: RunState):
    if not shown:
        return None
    from tqdm import tqdm
    return tqdm(total=state.total_steps, initial=state.global_step, unit="step", dynamic_ncols=True)


def _requests(t: Trainer) -> Control:
    """What rank 0 sees asked for now: a checkpoint (a stop checkpoints too), a stop, the control files' requests."""
    if not t.topology.is_main:
        return Control()
    save = dp_layout.take_signals(t.run_dir)   # diffusion-pipe's save / save_quit files
    stop = t.stopping()
    minutes = t.cfg.checkpoint_every_n_minutes
    due = minutes is not None and time.monotonic() - t.state.last_checkpoint_time >= minutes * 60
    asked, problems = run_control.take(t.run_dir)
    for problem in problems:
        t.reporter.event("warning", message=problem)
        log.warning(problem)
    return Control(due or stop or save, stop, asked)


def change_lr(t: Trainer, lr: float) -> None:
    """The base learning rate from the next step on (every rank); kept in the run's checkpoints."""
    set_base_lr(t.parts.engine.lr_scheduler, lr)
    t.state.base_lr = lr
    if t.topology.is_main:
        step = t.state.global_step
        run_control.record_lr(t.run_dir, lr, step + 1)   # before the event and status that acknowledge it
        t.reporter.event("control", action=run_control.LR, lr=lr, step=step, from_step=step + 1)
        t.reporter.update(base_lr=lr)
        log.info("learning rate %g from step %d on", lr, step + 1)


def _control_event(t: Trainer, action: str) -> None:
    if t.topology.is_main:
        t.reporter.event("control", action=action, step=t.state.global_step, epoch=t.state.epoch)
        if action == run_control.STOP_AFTER_EPOCH:   # the panel says so until the run stops
            t.reporter.update(stop_after_epoch=t.state.epoch)


def _report_step(reporter: RunReporter, epochs: int, global_batch: int, total_steps: int, s: FinishedStep,
                 started: float, bar) -> None:
    """``s.lr``: the learning rate the step used (read before the step; the schedule has moved on since)."""
    samples_per_s = global_batch / s.step_time
    elapsed = time.monotonic() - started
    eta = elapsed / s.steps_done * (total_steps - s.step)
    extra, scalars = {}, {"train/loss": s.loss, "train/lr": s.lr, "train/samples_per_s": samples_per_s}
    if torch.cuda.is_available():
        extra["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    if s.grad_norm is not None:
        extra["grad_norm"] = scalars["train/grad_norm"] = s.grad_norm
    if s.prodigy_d is not None:
        extra["prodigy_d"] = scalars["train/prodigy_d"] = s.prodigy_d
    for name, value in s.groups.items():   # is_reg directories: each kind's loss (train/loss_reg, train/loss_main)
        extra[name] = value
        if name.startswith("loss_"):
            scalars[f"train/{name}"] = value
    reporter.event("step", step=s.step, epoch=s.epoch, loss=s.loss, lr=s.lr, samples_per_s=samples_per_s,
                   step_time_s=s.step_time, total_steps=total_steps, **extra)
    reporter.update(state="training", step=s.step, total_steps=total_steps, epoch=s.epoch,
                    epochs=epochs, loss=s.loss, lr=s.lr, samples_per_s=samples_per_s, eta_s=eta)
    reporter.scalars(s.step, **scalars)
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{s.loss:.4f}", epoch=s.epoch)


def _evaluate(t: Trainer) -> None:
    evaluate(t.parts.eval_sets, t.parts.engine, t.cfg.eval_gradient_accumulation_steps, t.state, t.topology,
             t.reporter)


def _end_of_epoch(t: Trainer, epoch: int) -> bool:
    """The epoch's LoRA and samples; returns whether the epoch's checkpoint is due. The loop writes it only after
    the step's eval: a checkpoint marks everything due at its step as done, so a run killed in an eval (or in the
    samples) resumes from the checkpoint before and does them again."""
    cfg = t.cfg
    t.reporter.event("epoch", epoch=epoch, step=t.state.global_step)
    if cfg.save_every_n_epochs and epoch % cfg.save_every_n_epochs == 0:
        path = t.save_lora(epoch)
        t.state.last_saved_step = t.state.global_step
        t.render_samples(path, epoch)
    return bool(cfg.checkpoint_every_n_epochs and epoch % cfg.checkpoint_every_n_epochs == 0)


def run_loop(t: Trainer) -> None:
    """Train from ``t.state`` to its ``total_steps``, or until a stop (every rank)."""
    parts, state = t.parts, t.state
    engine, plan, feed = parts.engine, parts.plan, parts.feed
    steps_per_epoch = plan.steps_per_epoch()
    state.last_checkpoint_time = time.monotonic()
    if state.global_step == 0 and t.cfg.eval_before_first_step:
        _evaluate(t)
    bar = _progress_bar(t.topology.is_main and t.opts.progress, state)
    started = time.monotonic()

    epoch_losses: dict[int, list[float]] = {}   # rank 0: each epoch's step losses this process trained

    def report(s: FinishedStep) -> None:   # total_steps is fixed once the loop runs
        _report_step(t.reporter, t.cfg.epochs, parts.global_batch, state.total_steps, s, started, bar)
        epoch_losses.setdefault(s.epoch, []).append(s.loss)
    reports = StepReports(report, started, timing_event())   # rank 0 feeds it
    batches, batches_epoch = None, None
    reads_data = engine.is_first_stage() or engine.is_last_stage()   # middle stages never pull the feed
    profiler = StepProfiler.from_env(t.topology.rank)
    history = MemoryHistory.from_env(t.topology.rank)
    control = ControlFlags(t.topology.world, distributed.device())
    stop_after_epoch = False
    # only compiled regions replayed as CUDA graphs need the mark (a first call imports all of torch's compiler)
    graphed = t.cfg.compile and cuda_graphs_allowed(t.cfg)
    while state.global_step < state.total_steps:
        if batches_epoch != state.epoch:
            batches, batches_epoch = plan.epoch(state.epoch), state.epoch
        lr = engine.get_lr()[0]
        engine.reset_activation_shape()
        if graphed:
            torch.compiler.cudagraph_mark_step_begin()   # CUDA-graphed blocks: the last step's outputs are done with
        if profiler:
            profiler.before_step(state.global_step + 1)
        try:
            with injection.base_rows(PARTS) if parts.preservation else nullcontext():   # preservation.py: target rows
                loss = engine.train_batch(feed.step_iter(batches[state.step_in_epoch], state.epoch,
                                                         state.step_in_epoch))
        except torch.OutOfMemoryError as e:
            if history:
                history.write(f"out of memory in step {state.global_step + 1}: {str(e).splitlines()[0]}")
            raise
        if parts.ema is not None:   # train_batch ended with the optimizer step
            parts.ema.update()
        reg_sums = parts.loss_sums.step_sums(t.topology.world, control.device) if parts.loss_sums else None
        following = state.step_in_epoch + 1
        if reads_data and following < steps_per_epoch and state.global_step + 1 < state.total_steps:
            feed.prefetch(batches[following], state.epoch, following)
        state.global_step += 1
        state.step_in_epoch += 1
        if history:
            history.after(state.global_step)
        if profiler and (summary := profiler.after_step(state.global_step)):
            t.reporter.event("profile", folder=str(profiler.folder), **summary)
        if t.topology.is_main:
            # global_step counts this step now; issuing it reports the step before
            reports.issued(pending_step(state.global_step, state.epoch, lr, loss, parts.grad_norm.value,
                                        prodigy_d(engine.optimizer), reg_sums))
        now = control.exchange(_requests(t))
        asked = now.requests
        if asked.lr is not None:
            reports.flush()   # the steps before the change are reported before its event
            change_lr(t, asked.lr)
        if asked.stop_after_epoch and not stop_after_epoch:
            stop_after_epoch = True
            _control_event(t, run_control.STOP_AFTER_EPOCH)
        if (parts.save_every_steps and state.global_step % parts.save_every_steps == 0) or asked.save or asked.sample:
            reports.flush()
            for action in (run_control.SAVE, run_control.SAMPLE):
                if getattr(asked, action):
                    _control_event(t, action)
            path = t.save_lora(state.epoch, at_step=True)
            if asked.sample:
                _sample_now(t, path)
        finished_epoch, epoch_checkpoint = None, False
        if state.step_in_epoch == steps_per_epoch:
            state.step_in_epoch = 0
            state.epoch += 1
            finished_epoch = state.epoch - 1
            reports.flush()
            if losses := epoch_losses.pop(finished_epoch, None):
                # diffusion-pipe's train/epoch_loss: the mean step loss, over the steps trained since the start or
                # the resume (diffusion-pipe does not restore it either)
                t.reporter.epoch_scalar(finished_epoch, state.global_step, "train/epoch_loss", sum(losses) / len(losses))
            epoch_checkpoint = _end_of_epoch(t, finished_epoch)
        if eval_due(parts.eval_every_steps, t.cfg.eval_every_n_epochs, state.global_step, finished_epoch):
            reports.flush()
            _evaluate(t)
        # "stop after this epoch" on the epoch's last step: the run ends at the boundary (unless it ends there anyway)
        stop_now = now.stop or (stop_after_epoch and finished_epoch is not None
                                and state.global_step < state.total_steps)
        if now.checkpoint or asked.save or stop_now or epoch_checkpoint:
            reports.flush()
            t.save_checkpoint()
        if stop_now:
            _stopped(t, bar, after_epoch=finished_epoch if not now.stop else None)
            return
    reports.flush()
    _finished(t, bar)


def _sample_now(t: Trainer, path) -> None:
    """Samples from the step LoRA just saved, as an epoch's are rendered (every rank waits for rank 0)."""
    if t.cfg.samples is None:
        if t.topology.is_main:
            message = "sample now: the run has no [samples] prompts (add a Samples node, or [samples] to the config)"
            t.reporter.event("warning", message=message)
            log.warning(message)
        return
    t.render_samples(path, t.state.epoch)


def _stopped(t: Trainer, bar, after_epoch: int | None = None) -> None:
    """``after_epoch``: the epoch whose end a "stop after this epoch" request waited for."""
    if bar is not None:
        bar.close()
    if t.topology.is_main:
        t.run_dir.clear_stop()
        extra = {} if after_epoch is None else {"after_epoch": after_epoch}
        signum = t.signals.signum if t.signals is not None else None
        reason = f"stopped at step {t.state.global_step} after a checkpoint; resume with --resume {t.run_dir.name}"
        if signum is not None:
            reason = f"{describe(signum)} received: {reason}"
            extra["signal"] = signal.Signals(signum).name
        t.reporter.event("stopped", step=t.state.global_step, epoch=t.state.epoch, **extra)
        t.reporter.update(state="stopped", stop_after_epoch=None, stop_signal=signum, stop_reason=reason)
    log.info("stopped at step %d after a checkpoint; resume with --resume %s", t.state.global_step, t.run_dir.name)


def _finished(t: Trainer, bar) -> None:
    state = t.state
    if bar is not None:
        bar.close()
    _report_peak_memory(t)
    last_epoch = state.epoch - 1 if state.step_in_epoch == 0 else state.epoch
    if state.last_saved_step != state.global_step and state.global_step > 0:
        # a resume that ends inside the epoch it last saved rewrites that epoch's LoRA with the newer weights
        path = t.save_lora(last_epoch)
        state.last_saved_step = state.global_step
        t.render_samples(path, last_epoch)
    t.save_checkpoint()
    if t.topology.is_main:
        t.run_dir.clear_stop()   # asked for too late: the run had finished
        t.reporter.event("done", step=state.global_step, epoch=last_epoch)
        t.reporter.update(state="finished", stop_after_epoch=None)



def _report_peak_memory(t: Trainer) -> None:
    """A ``memory`` event with every rank's peak GPU memory (GiB, global rank order) as training ends, before the
    final saves: the step events carry rank 0's only, and pipeline stages differ (stage 0 keeps the most
    micro-batches in flight). One gather; nothing on CPU ranks."""
    if not torch.cuda.is_available():
        return
    peaks = distributed.all_gather_object(round(torch.cuda.max_memory_allocated() / 2 ** 30, 3))
    if t.topology.is_main:
        t.reporter.event("memory", step=t.state.global_step, peak_mem_gib_per_rank=peaks)
