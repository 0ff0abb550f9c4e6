"""Stop, checkpoint and the run-control requests (save or sample now, stop after this epoch, a new learning rate:
``backend/run/control.py``) that every rank acts on at the same step, without a host sync each step.

Rank 0 decides (the stop file, a signal, the checkpoint clock, the control files) and the other ranks must follow
at the same step. Sharing a Python object (``broadcast_object_list``) copies through pageable memory, which waits
for all the GPU work queued so far: each step would end with the host idle until the device finished and the
device idle while the host queued the next step. Here the flags travel as a small device tensor broadcast behind
the step's work, are copied to pinned host memory behind the broadcast, and are read one step later, once the
next step is queued: every rank then acts one step after rank 0 saw the request. A single process acts on the
same step. The tensor is float64 so that a learning rate travels in it exactly beside the 0/1 flags.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..run.control import Requests
from .reporting import host_copy, timing_event


@dataclass(frozen=True)
class Control:
    """What to do at this step: a checkpoint, a stop (after a checkpoint), and the run-control requests."""
    checkpoint: bool = False
    stop: bool = False
    requests: Requests = Requests()

    def as_values(self) -> list[float]:
        r = self.requests
        return [float(self.checkpoint), float(self.stop), float(r.save), float(r.sample), float(r.stop_after_epoch),
                r.lr if r.lr is not None else 0.0]   # 0: no new learning rate (a valid one is > 0)

    @classmethod
    def from_values(cls, values: list[float]) -> "Control":
        checkpoint, stop, save, sample, stop_after_epoch, lr = values
        return cls(bool(checkpoint), bool(stop), Requests(bool(save), bool(sample), bool(stop_after_epoch),
                                                          lr if lr > 0 else None))


class ControlFlags:
    def __init__(self, world: int, device: torch.device):
        self.world, self.device = world, device
        self._posted: tuple[torch.Tensor, torch.cuda.Event | None] | None = None   # host flags, ready event

    def exchange(self, wanted: Control) -> Control:
        """Every rank calls this once a step with its own view (only rank 0's counts); returns what to act on now:
        ``wanted`` in a single process, the previous call's with several ranks."""
        if self.world == 1:
            return wanted
        previous = self._take()
        # a checkpoint acted on now resets the clock that asked for this one
        self._post(replace(wanted, checkpoint=wanted.checkpoint and not previous.checkpoint))
        return previous

    def _post(self, wanted: Control) -> None:
        flags = torch.tensor(wanted.as_values(), dtype=torch.float64)
        cuda = self.device.type == "cuda"
        if cuda:
            flags = flags.pin_memory().to(self.device, non_blocking=True)
        dist.broadcast(flags, src=0)
        if cuda:
            self._posted = (host_copy(flags), timing_event())
        else:
            self._posted = (flags, None)

    def _take(self) -> Control:
        if self._posted is None:
            return Control()
        host, done = self._posted
        if done is not None:
            done.synchronize()   # the previous step and the broadcast behind it, not the step queued since
        self._posted = None      # each request is acted on once
        return Control.from_values(host.tolist())
