# SPDX-License-Identifier: GPL-3.0-or-later
"""Images from a ComfyUI graph written as a content-addressed dataset folder."""
import numpy as np
import pytest
from PIL import Image

from pipetrain.backend.data.graph_dataset import COMPLETE, split_captions, write_dataset


def _images(n=3, seed=0, size=(40, 48)):
    return np.random.default_rng(seed).integers(0, 256, (n, *size, 3), dtype=np.uint8)


def test_each_image_is_a_png_with_its_caption_and_the_same_content_gives_the_same_folder(tmp_path):
    images = _images()
    folder = write_dataset(images, ["a red cube", "a blue ball", "a green cone"], tmp_path, "toys")
    assert folder.name.startswith("toys-") and (folder / COMPLETE).exists()
    pngs = sorted(folder.glob("*.png"))
    assert len(pngs) == 3
    written = {p.with_suffix(".txt").read_text(): np.asarray(Image.open(p)) for p in pngs}
    for image, caption in zip(images, ["a red cube", "a blue ball", "a green cone"]):
        assert np.array_equal(written[caption], image)          # lossless, caption beside its own image
    mtimes = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert write_dataset(images, ["a red cube", "a blue ball", "a green cone"], tmp_path, "toys") == folder
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == mtimes       # nothing rewritten
    # another caption or another pixel: another folder, the first left as it was
    assert write_dataset(images, ["a red cube", "a blue ball", "a cone"], tmp_path, "toys") != folder
    changed = images.copy()
    changed[0, 0, 0, 0] ^= 1
    assert write_dataset(changed, ["a red cube", "a blue ball", "a green cone"], tmp_path, "toys") != folder
    assert not list(tmp_path.glob(".*partial"))


def test_one_caption_serves_every_image_and_an_interrupted_folder_is_rebuilt(tmp_path):
    folder = write_dataset(_images(2), split_captions("sks dog\n\n"), tmp_path)
    assert [p.read_text() for p in folder.glob("*.txt")] == ["sks dog", "sks dog"]
    (folder / COMPLETE).unlink()
    next(folder.glob("*.png")).unlink()
    assert write_dataset(_images(2), ["sks dog"], tmp_path) == folder
    assert len(list(folder.glob("*.png"))) == 2 and (folder / COMPLETE).exists()


@pytest.mark.parametrize("images,captions,name,message", [
    (_images(3), ["a", "b"], "graph", "captions: 2 lines for 3 images"),
    (_images(1), ["a"], "../up", "name '../up'"),
    (_images(1), ["a"], "-rf", "name '-rf'"),
    (_images(1, size=(8, 8)), ["a"], "graph", "each side must be 16"),
    (np.zeros((2, 32, 32), np.uint8), ["a"], "graph", "images: expected a batch of RGB images"),
])
def test_bad_inputs_are_refused_naming_the_input(tmp_path, images, captions, name, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        write_dataset(images, captions, tmp_path, name)
    assert not any(tmp_path.iterdir())
