# SPDX-License-Identifier: GPL-3.0-or-later
"""The node forms without a server: parsing, spec building and dataset chaining."""
from __future__ import annotations

import pytest

from pipetrain.backend.runtime import ensure_comfyui
from pipetrain.launcher.specs import DatasetSpec, DirectorySpec


@pytest.fixture(scope="module")
def forms():
    ensure_comfyui()
    from pipetrain.nodes import NODES, data, settings
    return NODES, data, settings


def test_parsers(forms):
    _, data, settings = forms
    assert data.parse_resolutions("512, 768") == (512, 768)
    for bad in ("", "500", "a"):
        with pytest.raises(ValueError):
            data.parse_resolutions(bad)
    assert settings.parse_gpu_ids("2, 3") == (2, 3) and settings.parse_gpu_ids("") == ()
    with pytest.raises(ValueError):
        settings.parse_gpu_ids("1,1")
    assert "does not divide" in settings.ParallelismNode.validate_inputs(gpus=3, pipeline_stages=2, gpu_ids="")
    assert settings.ParallelismNode.validate_inputs(gpus=4, pipeline_stages=2, gpu_ids="0,1,2,3") is True


def test_specs_are_hashable_and_datasets_chain(forms):
    nodes, _, settings = forms
    a = DatasetSpec((DirectorySpec("/a"),))
    b = DatasetSpec((DirectorySpec("/b", num_repeats=3),), resolutions=(1024,))
    chained = a.plus(b)
    assert [d.path for d in chained.directories] == ["/b", "/a"] and chained.resolutions == (1024,)
    assert hash(chained) == hash(a.plus(b))
    out = settings.ParallelismNode.execute(gpus=2, pipeline_stages=2, micro_batch_size_per_gpu=1,
                                           gradient_accumulation_steps=1, gpu_ids="4,5")
    assert out.result[0].devices == (4, 5)
    forms_only = [settings.AdapterNode, settings.OptimizerNode, settings.ScheduleNode, settings.ParallelismNode,
                  settings.MemoryNode]
    assert all(n in nodes for n in forms_only)
    assert {n.define_schema().category for n in forms_only} == {"PipeTrain"}
