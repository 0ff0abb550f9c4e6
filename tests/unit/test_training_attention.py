# SPDX-License-Identifier: GPL-3.0-or-later
"""Training orders the SDPA backends for training where ComfyUI orders them for inference (0.33 puts flash
attention first on every CUDA machine; on a CPU it sets no order, so the test sets 0.33's as it would)."""
import pytest
from torch.nn.attention import SDPBackend

from pipetrain.backend.host.runtime import comfy_training_paths, ensure_comfyui

INFERENCE = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@pytest.fixture
def host_priority():
    ensure_comfyui()
    import comfy.ops
    had = hasattr(comfy.ops, "SDPA_BACKEND_PRIORITY")
    before = getattr(comfy.ops, "SDPA_BACKEND_PRIORITY", None)
    comfy.ops.SDPA_BACKEND_PRIORITY = list(INFERENCE)
    yield comfy.ops.SDPA_BACKEND_PRIORITY
    if had:
        comfy.ops.SDPA_BACKEND_PRIORITY = before
    else:
        del comfy.ops.SDPA_BACKEND_PRIORITY


def test_the_training_paths_put_cudnn_attention_first_and_give_comfys_order_back(host_priority):
    with comfy_training_paths(True):
        assert host_priority[0] == SDPBackend.CUDNN_ATTENTION
        assert sorted(host_priority, key=str) == sorted(INFERENCE, key=str)
    assert host_priority == INFERENCE
    with comfy_training_paths(False):   # ComfyUI's inference forward (the parity reference) keeps its own
        assert host_priority == INFERENCE
