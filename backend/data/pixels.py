"""Turning an image file into the pixel tensor a bucket trains on."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image, ImageOps

from ..errors import DatasetError

if TYPE_CHECKING:
    import torch

# Cache keys include this: bump it whenever load_pixels returns different pixels for the same file.
PREPROCESS_VERSION = "1"


def _cover_and_center_crop(image: Image.Image, width: int, height: int) -> Image.Image:
    """Scale (keeping the aspect ratio) until the image covers width x height, then crop the middle."""
    scale = max(width / image.width, height / image.height)
    scaled = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    if scaled != image.size:
        image = image.resize(scaled, Image.Resampling.LANCZOS)
    left = (image.width - width) // 2
    top = (image.height - height) // 2
    return image.crop((left, top, left + width, top + height))


def load_pixels(path: Path, bucket: tuple[int, int], data: bytes | None = None) -> "torch.Tensor":
    """RGB float32 tensor [H, W, 3] in 0..1 (ComfyUI's IMAGE layout without the batch dimension); ``data``: the
    file's bytes, already read (decoded instead of reading ``path`` again)."""
    import io

    import numpy as np
    import torch

    width, height = bucket
    try:
        with Image.open(path if data is None else io.BytesIO(data)) as opened:
            image = ImageOps.exif_transpose(opened).convert("RGB")
    except Exception as e:  # Pillow raises many types for bad files
        raise DatasetError(f"{path}: cannot read the image ({type(e).__name__}: {e}); "
                           "remove the file or replace it with a readable image") from e
    image = _cover_and_center_crop(image, width, height)
    return torch.from_numpy(np.array(image, dtype=np.float32)).div_(255.0)
