# SPDX-License-Identifier: GPL-3.0-or-later
"""Masked training (diffusion-pipe's mask_path / default_mask_file): masks paired by stem, turned into weights on
the latent grid, and the loss weighted by them."""
import pytest
import torch
from PIL import Image

from pipetrain.backend.models.losses import Loss


def test_the_mask_weighs_each_element_and_the_mean_stays_over_every_element():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 4, 6, 8, generator=g)
    mask = torch.rand(2, 1, 6, 8, generator=g)
    for kind in ("mse", "l1", "huber"):
        loss = Loss(kind)
        per_element = loss.elementwise(pred, target, "none")
        assert torch.allclose(loss(pred, target, mask=mask), (per_element * mask).mean())
        weights = torch.tensor([0.5, 2.0])
        expected = ((per_element * mask).flatten(1).mean(1) * weights).mean()
        assert torch.allclose(loss(pred, target, weights, mask), expected)
    assert loss(pred, target, mask=torch.ones(2, 1, 6, 8)) == loss(pred, target)
    assert loss(pred, target, mask=torch.zeros(2, 1, 6, 8)) == 0


def test_a_mask_image_becomes_red_channel_weights_on_the_latent_grid(tmp_path):
    from pipetrain.backend.cache.builder import latent_mask

    mask = Image.new("RGB", (64, 48), (0, 255, 255))          # red 0 everywhere: green and blue are ignored
    mask.paste((255, 0, 0), (0, 0, 32, 48))                    # the left half white in red
    mask.save(tmp_path / "a.png")
    weights = latent_mask(tmp_path / "a.png", (64, 48), torch.zeros(16, 6, 8))
    assert weights.shape == (1, 6, 8)
    assert torch.all(weights[..., :4] == 1) and torch.all(weights[..., 4:] == 0)
    clip = latent_mask(tmp_path / "a.png", (64, 48, 9), torch.zeros(16, 3, 6, 8))
    assert clip.shape == (1, 1, 6, 8) and torch.equal(clip[0], weights)


def _dataset(tmp_path, **directory):
    from pipetrain.backend.config import DatasetConfig
    from pipetrain.backend.config.schema import from_dict

    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    for name in ("a", "b"):
        Image.new("RGB", (32, 32)).save(images / f"{name}.png")
    return from_dict(DatasetConfig, {"directory": [{"path": str(images), **directory}]},
                     file=tmp_path / "dataset.toml")


def test_masks_pair_by_stem_and_the_default_covers_the_rest(tmp_path):
    from pipetrain.backend.data import scan_dataset

    (tmp_path / "masks").mkdir()
    Image.new("RGB", (32, 32), (255, 0, 0)).save(tmp_path / "masks" / "a.jpg")
    Image.new("RGB", (32, 32)).save(tmp_path / "black.png")
    items = scan_dataset(_dataset(tmp_path, mask_path=str(tmp_path / "masks"),
                                  default_mask_file=str(tmp_path / "black.png"))).items
    assert {i.path.stem: i.mask.name for i in items} == {"a": "a.jpg", "b": "black.png"}
    assert all(i.mask is None for i in scan_dataset(_dataset(tmp_path)).items)


@pytest.mark.parametrize("key", ["mask_path", "default_mask_file"])
def test_a_missing_mask_folder_or_file_is_named_with_its_key(tmp_path, key):
    from pipetrain.backend.data import scan_dataset
    from pipetrain.backend.errors import DatasetError

    with pytest.raises(DatasetError, match=f"directory.{key}"):
        scan_dataset(_dataset(tmp_path, **{key: str(tmp_path / "nowhere")}))
