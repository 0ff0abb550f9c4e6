"""Stop, checkpoint and run-control requests: rank 0's view reaches every rank, one step late with several ranks
(no host sync in the step), at once in a single process; a learning rate travels exactly."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipetrain.backend.process.command_lines import free_port
from pipetrain.backend.run.control import Requests
from pipetrain.backend.train.control import Control, ControlFlags

LR = 3.7e-5   # not a float32 number: the float64 flags must carry it bit for bit
# what rank 0 sees at each step; the other rank's own view must not count
RANK0_SEES = [Control(), Control(True), Control(True, requests=Requests(lr=LR)),
              Control(requests=Requests(save=True, sample=True)), Control(True, True, Requests(stop_after_epoch=True))]
OTHER_SEES = Control(True, True, Requests(True, True, True, 1.0))


def _exchange_on_two_ranks(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        control = ControlFlags(2, torch.device("cpu"))
        seen = RANK0_SEES if rank == 0 else [OTHER_SEES] * len(RANK0_SEES)
        results[rank] = [control.exchange(wanted) for wanted in seen]
    finally:
        dist.destroy_process_group()


def test_with_two_ranks_both_act_on_rank_0s_requests_one_step_later():
    port = free_port()
    results = mp.Manager().dict()
    mp.spawn(_exchange_on_two_ranks, args=(port, results), nprocs=2)
    expected = [Control(),         # nothing posted before the first step
                Control(),
                Control(True),     # step 2's checkpoint request, acted on at step 3 ...
                Control(requests=Requests(lr=LR)),   # ... which also resets the clock, so step 3's repeat is dropped
                Control(requests=Requests(save=True, sample=True))]
    assert results[0] == results[1] == expected
    assert results[1][3].requests.lr == LR


def test_a_single_process_acts_at_once():
    control = ControlFlags(1, torch.device("cpu"))
    assert [control.exchange(wanted) for wanted in RANK0_SEES] == RANK0_SEES


def _exchange_on_cuda(rank: int, port: int, backend: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=2)
    try:
        control = ControlFlags(2, device)
        seen = RANK0_SEES if rank == 0 else [OTHER_SEES] * len(RANK0_SEES)
        got, busy = [], []
        for wanted in seen:
            torch.cuda._sleep(50_000_000)    # a step's work, tens of milliseconds of it
            got.append(control.exchange(wanted))
            busy.append(not torch.cuda.current_stream().query())
        torch.cuda.synchronize()
        results[rank] = (got, busy)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_the_flags_travel_exactly_and_no_step_waits_for_the_gpu():
    """Through pinned memory and a device broadcast: the same values as on the CPU (the learning rate bit for bit).
    With NCCL (two GPUs) each exchange returns while the step's work still runs; gloo, the stand-in on one GPU,
    waits for its broadcast by design, so only the values are checked there."""
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    results = mp.Manager().dict()
    mp.spawn(_exchange_on_cuda, args=(free_port(), backend, results), nprocs=2)
    expected = [Control(), Control(), Control(True), Control(requests=Requests(lr=LR)),
                Control(requests=Requests(save=True, sample=True))]
    assert results[0][0] == results[1][0] == expected
    if backend == "nccl":
        assert all(results[0][1][1:]) and all(results[1][1][1:]), results[0][1]
