"""Qwen-Image-Edit's captions are read together with the control image, exactly as ComfyUI's
TextEncodeQwenImageEditPlus reads a prompt with ``image1``: the same tensors, cached under a key that covers the
image (a tiny Qwen2.5-VL whose vision tower is the real 32-layer one, random-initialised); Qwen-Image-Edit-2509's
with both of its control images as the node reads image1 and image2."""
import hashlib
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


class SeenImages:
    """ComfyUI's vision tower of one loaded CLIP, answering an input it has already read (the same pixels, the same
    grid, compared by their bytes) with what it answered then. Its 32 real-size layers at the fixed 384x384 area are
    nearly all of this file's time, and most of its reads repeat one: the edit node's read of our images (when ours
    fed the tower the very same pixels), the second model's reads of the first model's pictures, an unchanged second
    image. An input that differs in any bit runs the tower; ``hits`` counts the inputs it did not run again."""

    def __init__(self, visual):
        self.tower, self.answers, self.hits = visual.forward, {}, 0
        visual.forward = self

    def __call__(self, pixels, grid):
        key = (hashlib.sha256(pixels.detach().contiguous().numpy().tobytes()).hexdigest(), str(pixels.dtype),
               tuple(pixels.shape), tuple(grid.flatten().tolist()))
        if key in self.answers:
            self.hits += 1
        else:
            self.answers[key] = self.tower(pixels, grid)
        return self.answers[key].clone()   # a copy: the caller may write into what it gets


@pytest.fixture(scope="module")
def loaded_text_encoders():
    """ComfyUI's CLIP of a text-encoder file, by the file's identity, with its vision tower's ``SeenImages``: both
    edit models' tiny Qwen2.5-VL file is one file (the tiny files share identical content), whose load builds the
    real-size vision tower: loaded once."""
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
    if same_file not in loaded_text_encoders:   # the adapter's own load, as sampling._text would do it
        clip = adapter.load_text_encoders()
        (visual,) = (m for m in clip.cond_stage_model.modules() if type(m).__name__ == "Qwen2VLVisionTransformer")
        loaded_text_encoders[same_file] = clip, SeenImages(visual)
    clip, seen = loaded_text_encoders[same_file]
    state = {"clip": clip}
    store = CacheStore(tmp_path / "cache")
    ours = sampling._text(adapter, store, PROMPT, state, controls, bucket)["context"]

    from comfy_extras.nodes_qwen import TextEncodeQwenImageEditPlus
    images = {f"image{k}": load_pixels(c, bucket)[None] for k, c in enumerate(controls, start=1)}
    hits = seen.hits
    theirs = TextEncodeQwenImageEditPlus.execute(clip, PROMPT, **images)[0][0][0]
    assert seen.hits == hits + len(controls), "the edit node fed the vision tower other pixels than ours"
    assert ours.shape == theirs.shape[1:] and torch.allclose(ours, theirs[0].float(), atol=1e-6)
    text_only = adapter.encode_caption(clip, PROMPT)["context"]
    assert ours.shape[0] > text_only.shape[0] + 100        # the image's vision tokens are in the sequence

    _picture(control, (200, 40, 0))                        # another image, same file name
    again = sampling._text(adapter, store, PROMPT, state, controls, bucket)["context"]
    assert again.shape == ours.shape and not torch.allclose(again, ours)
