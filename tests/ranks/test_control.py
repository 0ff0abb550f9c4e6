"""Stop, checkpoint and run-control requests: rank 0's view reaches every rank, one step late with several ranks
(no host sync in the step), at once in a single process; a learning rate travels exactly."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipetrain.backend.commands import free_port
from pipetrain.backend.run_control import Requests
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
