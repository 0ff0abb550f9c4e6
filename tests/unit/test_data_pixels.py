"""load_pixels: EXIF transpose, RGB, cover-resize and centre crop to the bucket, ComfyUI IMAGE layout."""
import pytest
import torch
from PIL import Image

from pipetrain.backend.data import PREPROCESS_VERSION, load_pixels
from pipetrain.backend.errors import DatasetError

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def striped(width: int, height: int, stripes) -> Image.Image:
    """Vertical stripes: each (colour, columns) in order, left to right."""
    image = Image.new("RGB", (width, height))
    left = 0
    for colour, columns in stripes:
        image.paste(colour, (left, 0, left + columns, height))
        left += columns
    return image


def test_shape_dtype_and_range(tmp_path):
    path = tmp_path / "noise.png"
    Image.effect_noise((100, 70), 80).convert("RGB").save(path)

    pixels = load_pixels(path, (48, 32))

    assert pixels.shape == (32, 48, 3)
    assert pixels.dtype == torch.float32
    assert pixels.min() >= 0 and pixels.max() <= 1


def test_exact_size_is_centre_cropped_without_resizing(tmp_path):
    path = tmp_path / "stripes.png"
    striped(64, 32, [(RED, 16), (GREEN, 32), (BLUE, 16)]).save(path)

    pixels = load_pixels(path, (32, 32))

    assert torch.equal(pixels, torch.tensor(GREEN, dtype=torch.float32).div(255).expand(32, 32, 3))


def test_resized_to_cover_the_bucket_then_centre_cropped(tmp_path):
    path = tmp_path / "stripes.png"
    striped(256, 64, [(RED, 64), (GREEN, 128), (BLUE, 64)]).save(path)

    pixels = load_pixels(path, (32, 32))  # scaled to 128x32, the middle 32 columns are green

    assert pixels.shape == (32, 32, 3)
    assert torch.equal(pixels[:, 4:28], torch.tensor(GREEN, dtype=torch.float32).div(255).expand(32, 24, 3))


def test_tall_image_is_cropped_top_and_bottom(tmp_path):
    path = tmp_path / "tall.png"
    image = Image.new("RGB", (32, 96), BLUE)  # blue top and bottom thirds, green middle
    image.paste(GREEN, (0, 32, 32, 64))
    image.save(path)

    pixels = load_pixels(path, (32, 32))

    assert torch.equal(pixels, torch.tensor(GREEN, dtype=torch.float32).div(255).expand(32, 32, 3))


def test_exif_orientation_is_applied(tmp_path):
    # stored 64x32, left half red and right half blue; orientation 6 displays it rotated 90 degrees clockwise
    path = tmp_path / "rotated.png"
    exif = Image.Exif()
    exif[0x0112] = 6
    striped(64, 32, [(RED, 32), (BLUE, 32)]).save(path, exif=exif)

    pixels = load_pixels(path, (32, 64))

    assert pixels.shape == (64, 32, 3)
    assert torch.equal(pixels[:32], torch.tensor(RED, dtype=torch.float32).div(255).expand(32, 32, 3))
    assert torch.equal(pixels[32:], torch.tensor(BLUE, dtype=torch.float32).div(255).expand(32, 32, 3))


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK"])
def test_other_modes_become_rgb(tmp_path, mode):
    path = tmp_path / f"image.{'jpg' if mode == 'CMYK' else 'png'}"
    Image.new("RGB", (16, 16), (255, 255, 255)).convert(mode).save(path)

    pixels = load_pixels(path, (16, 16))

    assert pixels.shape == (16, 16, 3)
    assert pixels.min() > 0.95


def test_unreadable_file_raises_dataset_error_naming_it(tmp_path):
    path = tmp_path / "broken.png"
    path.write_bytes(b"nope")

    with pytest.raises(DatasetError, match="broken.png"):
        load_pixels(path, (16, 16))


def test_preprocess_version_is_a_non_empty_string():
    assert isinstance(PREPROCESS_VERSION, str) and PREPROCESS_VERSION
