# SPDX-License-Identifier: GPL-3.0-or-later
"""A rank started on a machine with fewer GPUs than ranks says so, instead of CUDA's "invalid device ordinal"."""
from __future__ import annotations

import pytest
import torch

from pipetrain.backend.errors import RuntimeSetupError
from pipetrain.backend.train import distributed


def test_a_rank_past_the_machines_gpus_is_refused_with_the_counts_and_the_fix(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # a one-GPU machine, as torch reports it
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    set_device = []
    monkeypatch.setattr(torch.cuda, "set_device", set_device.append)
    with pytest.raises(RuntimeSetupError, match=r"rank 1 of this machine has no GPU: 2 ranks were started here, but "
                                                r"this machine shows 1 GPU\(s\)\. Start at most 1 "):
        distributed.init()
    assert set_device == []                                          # refused before CUDA was asked for the device
