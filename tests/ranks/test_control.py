"""Stop and checkpoint requests: rank 0's view reaches every rank, one step late with several ranks (no host sync
in the step), at once in a single process."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipetrain.backend.commands import free_port
from pipetrain.backend.train.control import ControlFlags

# what rank 0 sees at each step; the other rank's own view must not count
RANK0_SEES = [(False, False), (True, False), (True, False), (False, False), (True, True)]


def _exchange_on_two_ranks(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        control = ControlFlags(2, torch.device("cpu"))
        seen = RANK0_SEES if rank == 0 else [(True, True)] * len(RANK0_SEES)
        results[rank] = [control.exchange(*flags) for flags in seen]
    finally:
        dist.destroy_process_group()


def test_with_two_ranks_both_act_on_rank_0s_requests_one_step_later():
    port = free_port()
    results = mp.Manager().dict()
    mp.spawn(_exchange_on_two_ranks, args=(port, results), nprocs=2)
    expected = [(False, False),   # nothing posted before the first step
                (False, False),
                (True, False),    # step 2's checkpoint request, acted on at step 3 ...
                (False, False),   # ... which also resets the clock, so step 3's repeat of it is dropped
                (False, False)]
    assert results[0] == results[1] == expected


def test_a_single_process_acts_at_once():
    control = ControlFlags(1, torch.device("cpu"))
    assert [control.exchange(*flags) for flags in RANK0_SEES] == RANK0_SEES
