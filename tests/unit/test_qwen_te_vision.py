"""A Qwen2.5-VL text-encoder file without its vision tower is refused, naming the file, for Qwen-Image-Edit
(which reads captions with the control image) before ComfyUI would build the tower uninitialised."""
import struct

import pytest


def _sparse_safetensors(path, plan):
    """A real-size bfloat16 safetensors file whose data is a sparse hole: headers are all loading's checks read."""
    import torch

    from pipetrain.backend.models import tiny

    header = tiny._header(plan, torch.bfloat16, {}, {})
    data = 2 * sum(int(torch.Size(shape).numel()) for _, shape, _ in plan)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + data)
    return path


def test_edit_model_refuses_a_vl_encoder_without_its_vision_tower(tmp_path):
    from pipetrain.backend.errors import ModelError
    from pipetrain.backend.models import loading, tiny

    module = tiny.build_text_encoder("qwen25_7b", tiny.text_encoder_config("qwen25_7b", "full"))
    plan = [row for row in tiny.tensor_plan(module) if not row[0].startswith("visual.")]
    text_only = _sparse_safetensors(tmp_path / "qwen_2.5_vl_7b_text_only.safetensors", plan)
    with pytest.raises(ModelError, match="qwen_2.5_vl_7b_text_only.safetensors: this Qwen2.5-VL-7B file has no "
                                         "vision tower"):
        loading.load_text_encoders([text_only], "qwen_image_edit", None)
