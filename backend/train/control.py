"""Stop and checkpoint requests that every rank acts on at the same step, without a host sync each step.

Rank 0 decides (the stop file, a signal, the checkpoint clock) and the other ranks must follow at the same step.
Sharing a Python object (``broadcast_object_list``) copies through pageable memory, which waits for all the GPU
work queued so far: each step would end with the host idle until the device finished and the device idle while
the host queued the next step. Here the flags travel as a small device tensor broadcast behind the step's work,
are copied to pinned host memory behind the broadcast, and are read one step later, once the next step is
queued: every rank then acts one step after rank 0 saw the request. A single process acts on the same step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .reporting import host_copy, timing_event


class ControlFlags:
    def __init__(self, world: int, device: torch.device):
        self.world, self.device = world, device
        self._posted: tuple[torch.Tensor, torch.cuda.Event | None] | None = None   # host flags, ready event

    def exchange(self, checkpoint: bool, stop: bool) -> tuple[bool, bool]:
        """Every rank calls this once a step with its own view (only rank 0's counts); returns the (checkpoint,
        stop) to act on now: these flags in a single process, the previous call's with several ranks."""
        if self.world == 1:
            return checkpoint, stop
        previous = self._take()
        # a checkpoint acted on now resets the clock that asked for this one
        self._post(checkpoint and not previous[0], stop)
        return previous

    def _post(self, checkpoint: bool, stop: bool) -> None:
        flags = torch.tensor([int(checkpoint), int(stop)], dtype=torch.int32)
        cuda = self.device.type == "cuda"
        if cuda:
            flags = flags.pin_memory().to(self.device, non_blocking=True)
        dist.broadcast(flags, src=0)
        if cuda:
            self._posted = (host_copy(flags), timing_event())
        else:
            self._posted = (flags, None)

    def _take(self) -> tuple[bool, bool]:
        if self._posted is None:
            return False, False
        host, done = self._posted
        if done is not None:
            done.synchronize()   # the previous step and the broadcast behind it, not the step queued since
        checkpoint, stop = (bool(v) for v in host.tolist())
        return checkpoint, stop
