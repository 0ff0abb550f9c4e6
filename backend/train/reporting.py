"""Step reports one step late. Reading a step's loss right after ``train_batch`` waits for the device to
finish the step, and the device then idles while the host reports, checks the stop flags and queues the
next step. Instead the loop keeps the step as a ``PendingStep`` (its loss and gradient norm copied to host
memory behind the step's work, and a CUDA event after the copies) and reports it once the next step is
queued, when waiting for that event costs the device nothing."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .reg_loss import group_losses


@dataclass
class PendingStep:
    """A step queued on the device, with what it used and produced captured when it was issued (the next
    step replaces the gradient norm and moves the learning rate on)."""
    step: int
    epoch: int
    lr: float
    loss: torch.Tensor | float
    grad_norm: torch.Tensor | None = None
    prodigy_d: float | None = None
    done: torch.cuda.Event | None = None    # None on CPU, where train_batch returns with the step's work done
    issued_at: float = field(default_factory=time.monotonic)
    reg_sums: torch.Tensor | None = None    # is_reg directories: the loss sums per kind (``reg_loss.py``)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into pinned host memory behind the work queued on the current stream (read it once an event
    recorded after the copy has completed)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t.detach(), non_blocking=True)


def pending_step(step: int, epoch: int, lr: float, loss, grad_norm: torch.Tensor | None,
                 prodigy_d: float | None, reg_sums: torch.Tensor | None = None) -> PendingStep:
    """The step just issued. On CUDA its values are copied to host memory on the current stream and an event is
    recorded after them: reading them then waits for this step alone, where a ``.item()`` on the device tensor
    would wait for everything queued since, the next step included."""
    if not (torch.is_tensor(loss) and loss.is_cuda):
        return PendingStep(step, epoch, lr, loss.detach() if torch.is_tensor(loss) else loss, grad_norm, prodigy_d,
                           reg_sums=reg_sums)
    if grad_norm is not None and grad_norm.is_cuda:
        grad_norm = host_copy(grad_norm)
    if reg_sums is not None and reg_sums.is_cuda:
        reg_sums = host_copy(reg_sums)
    loss = host_copy(loss)
    return PendingStep(step, epoch, lr, loss, grad_norm, prodigy_d, timing_event(), reg_sums=reg_sums)


def timing_event() -> torch.cuda.Event | None:
    """An event recorded now on the current CUDA stream, that times the device work between two of them; None
    on CPU."""
    if not torch.cuda.is_available():
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


@dataclass(frozen=True)
class FinishedStep:
    step: int
    epoch: int
    lr: float
    loss: float
    grad_norm: float | None
    prodigy_d: float | None
    step_time: float      # from the previous step's end: what happens between steps counts, as in the wall clock
    steps_done: int       # steps reported since the loop started
    groups: dict = field(default_factory=dict)   # loss_reg, loss_main, reg_samples (``reg_loss.group_losses``)


class StepReports:
    """Hands each step to ``report`` once the next one is issued, or at once on ``flush``: the loop flushes
    before whatever must follow the step in the events or takes time (LoRA saves, evals, checkpoints, the
    end), so the events stay in step order."""

    def __init__(self, report: Callable[[FinishedStep], None], started: float,
                 start: torch.cuda.Event | None = None):
        """``start``: an event recorded when the loop started (``timing_event()``). A step's time is then read
        between events on the device's own clock, the previous step's and its own: the host reads the step only
        once the next one is queued, which is later than it ended whenever the host, not the device, is the
        slower one."""
        self._report = report
        self._pending: PendingStep | None = None
        self._last_end, self._last_event = started, start
        self._steps_done = 0

    def issued(self, step: PendingStep) -> None:
        previous, self._pending = self._pending, step
        if previous is not None:
            self._finish(previous)

    def flush(self) -> None:
        if self._pending is not None:
            step, self._pending = self._pending, None
            self._finish(step)

    def _finish(self, step: PendingStep) -> None:
        if step.done is None:
            end = step.issued_at
        else:
            step.done.synchronize()
            end = time.monotonic()
        if step.done is not None and self._last_event is not None:
            step_time = self._last_event.elapsed_time(step.done) / 1000     # the device's clock
        else:
            step_time = end - self._last_end
        self._last_end, self._last_event = end, step.done
        self._steps_done += 1
        grad_norm = None if step.grad_norm is None else float(step.grad_norm)
        self._report(FinishedStep(step.step, step.epoch, step.lr, float(step.loss), grad_norm, step.prodigy_d,
                                  step_time, self._steps_done, group_losses(step.reg_sums)))
