# SPDX-License-Identifier: GPL-3.0-or-later
"""PIPETRAIN_MEMORY_HISTORY's report: live tensors grouped by the code that made them, largest first."""
from pipetrain.backend.train.memory_history import GIB, owner, summary


def _frame(path, line, name):
    return {"filename": path, "line": line, "name": name}


SWAP = [_frame("/usr/lib/python3/torch/cuda/memory.py", 1, "empty"),
        _frame("/opt/x/pipetrain/backend/train/swap.py", 77, "_copies"),
        _frame("/opt/x/pipetrain/backend/train/swap.py", 90, "prefetch")]
CAST = [_frame("/srv/ComfyUI/comfy/ops.py", 120, "cast_bias_weight"),
        _frame("/srv/ComfyUI/comfy/ops.py", 150, "forward_comfy_cast_weights")]


def test_the_report_adds_live_blocks_per_place_and_leaves_free_ones_out():
    snapshot = {"segments": [
        {"stream": 0, "total_size": 4 * GIB, "blocks": [
            {"size": GIB, "state": "active_allocated", "frames": CAST},
            {"size": GIB, "state": "active_allocated", "frames": CAST},
            {"size": GIB // 2, "state": "active_allocated", "frames": []},
            {"size": GIB // 2, "state": "inactive", "frames": CAST}]},
        {"stream": 7, "total_size": 2 * GIB, "blocks": [
            {"size": 3 * GIB // 2, "state": "active_pending_free", "frames": SWAP}]}]}
    lines = summary(snapshot).splitlines()
    assert lines[0] == "live tensors: 4.000 GiB"
    # largest first; the inactive (free, cached) block counts for its stream but for no owner
    assert lines[1].split() == ["2.000", "GiB", "2x", "comfy/ops.py:120", "cast_bias_weight", "<",
                                "comfy/ops.py:150", "forward_comfy_cast_weights"]
    assert lines[2].startswith("   1.500 GiB      1x  backend/train/swap.py:77 _copies < backend/train/swap.py:90")
    assert lines[3].endswith("(allocated before recording began)")
    assert "stream 7: active_pending_free 1.500, reserved 2.000" in lines[4]
    assert "inactive 0.500" in lines[4]


def test_an_allocation_outside_our_code_is_named_by_its_innermost_frame():
    assert owner([_frame("/x/torch/nn/functional.py", 5, "linear"), _frame("/x/mine.py", 9, "f")]) == \
        "torch/nn/functional.py:5 linear"
