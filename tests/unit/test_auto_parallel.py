# SPDX-License-Identifier: GPL-3.0-or-later
"""``pipeline_stages`` left to the launcher: the fewest stages dividing the ranks that fit each GPU."""
from __future__ import annotations

import dataclasses

from pipetrain.backend.memory import plan as mp


def fits(traced, training, stages: int, total: int) -> bool:
    return mp.choose(traced, dataclasses.replace(training, stages=stages), total, False) is not None


def smallest_total(traced, training, stages: int) -> int:
    """The fewest bytes (memory_limit_gib's way: not a whole GPU) in which ``stages`` stages fit."""
    low, high = 1, 4096 * mp.GIB
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(traced, training, stages, mid) else (mid + 1, high)
    return low


def test_the_fewest_stages_that_fit_are_chosen(tiny_flux_files, make_run, tmp_path):
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.memory.plan_config import footprints, largest_probe
    from pipetrain.launcher.auto_parallel import planned_stages

    memo = tmp_path / "memo"
    cfg = load_run_config(make_run(tiny_flux_files, images=2, name="probe"))
    traced = footprints(cfg, largest_probe(cfg), memo)
    training = mp.training_of(cfg)
    one, two = smallest_total(traced, training, 1), smallest_total(traced, training, 2)
    assert two < one, (one, two)         # a stage of half the blocks needs less: room for a limit between
    between = (one - 1) / mp.GIB

    def chosen(limit_gib, world, name):
        config = make_run(tiny_flux_files, images=2, name=name, memory_limit_gib=limit_gib)
        return planned_stages(config, (0,), world, memo)

    assert chosen(80, 4, "roomy")[0] == 1                       # fits one GPU: every other rank data parallel
    stages, why = chosen(between, 4, "tight")
    assert stages == 2 and "fewest that fit" in why, why        # not 4: 2 stages fit
    assert chosen(between, 3, "odd")[0] == 3                    # 2 does not divide 3 ranks
    assert chosen(between, 1, "alone") == (1, "one rank")
    stages, why = chosen(two / mp.GIB / 4, 2, "nothing")
    assert stages == 2 and "none fits" in why, why              # the queue-time plan then says what does not fit
