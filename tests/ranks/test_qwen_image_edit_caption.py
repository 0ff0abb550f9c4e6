"""Qwen-Image-Edit's captions are read together with the control image, exactly as ComfyUI's
TextEncodeQwenImageEditPlus reads a prompt with ``image1``: the same tensors, cached under a key that covers the
image (a tiny Qwen2.5-VL whose vision tower is the real 32-layer one, random-initialised); Qwen-Image-Edit-2509's
with both of its control images as the node reads image1 and image2."""
import os

import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.slow

PROMPT = "make the circle red"


def _picture(path, colour):
    image = Image.new("RGB", (80, 48), colour)
    image.paste((255, 255, 255), (20, 10, 50, 40))
    image.save(path)


@pytest.fixture(scope="module")
def loaded_text_encoders():
    """ComfyUI's CLIP of a text-encoder file, by the file's identity: both edit models' tiny Qwen2.5-VL file is one
    file (the tiny files share identical content), whose load builds the real-size vision tower: loaded once."""
    return {}


@pytest.mark.parametrize("model_type", ["qwen_image_edit", "qwen_image_edit_plus"])
def test_edit_captions_read_the_control_images_as_comfyuis_edit_node_does(model_files, tmp_path, model_type,
                                                                          loaded_text_encoders):
    from pipetrain.backend.sampling import render as sampling
    from pipetrain.backend.cache import CacheStore
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.data import load_pixels
    from pipetrain.backend.models.registry import adapter_class

    files = model_files(model_type)
    adapter = adapter_class(model_type)(ModelConfig(
        type=model_type, diffusion_model=str(files.diffusion_model), vae=str(files.vae),
        text_encoders=[str(p) for p in files.text_encoders]))
    control, bucket = tmp_path / "control.png", (64, 48)
    _picture(control, (0, 90, 200))
    controls = (control,)
    if model_type == "qwen_image_edit_plus":    # a second picture, of another shape (cropped to the bucket too)
        controls += (tmp_path / "second.png",)
        Image.new("RGB", (40, 90), (10, 200, 10)).save(controls[1])
    (encoder,) = files.text_encoders
    same_file = (os.stat(encoder).st_dev, os.stat(encoder).st_ino)
    state = {"clip": loaded_text_encoders[same_file]} if same_file in loaded_text_encoders else {}
    store = CacheStore(tmp_path / "cache")
    ours = sampling._text(adapter, store, PROMPT, state, controls, bucket)["context"]
    loaded_text_encoders[same_file] = state["clip"]

    from comfy_extras.nodes_qwen import TextEncodeQwenImageEditPlus
    clip = state["clip"]
    images = {f"image{k}": load_pixels(c, bucket)[None] for k, c in enumerate(controls, start=1)}
    theirs = TextEncodeQwenImageEditPlus.execute(clip, PROMPT, **images)[0][0][0]
    assert ours.shape == theirs.shape[1:] and torch.allclose(ours, theirs[0].float(), atol=1e-6)
    text_only = adapter.encode_caption(clip, PROMPT)["context"]
    assert ours.shape[0] > text_only.shape[0] + 100        # the image's vision tokens are in the sequence

    _picture(control, (200, 40, 0))                        # another image, same file name
    again = sampling._text(adapter, store, PROMPT, state, controls, bucket)["context"]
    assert again.shape == ours.shape and not torch.allclose(again, ours)
