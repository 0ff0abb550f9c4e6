"""Generated videos for tests: containers through PyAV, animated WebP through Pillow."""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

# codec, pixel format, options per container (lossless where the format allows, so frames can be told apart)
WRITERS = {
    ".mp4": ("libx264", "yuv444p", {"qp": "0"}),
    ".mkv": ("ffv1", "yuv444p", {}),
    ".webm": ("libvpx-vp9", "yuv444p", {"lossless": "1"}),
    ".gif": ("gif", "rgb8", {}),
}


def gray_frames(count: int, size=(48, 32)) -> list[np.ndarray]:
    """Frame i is a flat grey of level 10 + 15 i (mod 240): which source frame was picked shows in any pixel."""
    w, h = size
    return [np.full((h, w, 3), 10 + (15 * i) % 240, dtype=np.uint8) for i in range(count)]


def moving_square(count: int, size=(64, 64), rgb=(220, 40, 40)) -> list[np.ndarray]:
    w, h = size
    frames = []
    for i in range(count):
        a = np.full((h, w, 3), 240, dtype=np.uint8)
        x = 4 + (w - 24) * i // max(1, count - 1)
        a[h // 2 - 10:h // 2 + 10, x:x + 20] = rgb
        frames.append(a)
    return frames


def write_video(path: Path, frames: list[np.ndarray], fps: float, pix_fmt: str | None = None) -> Path:
    path = Path(path)
    if path.suffix == ".webp":
        images = [Image.fromarray(f) for f in frames]
        images[0].save(path, save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0,
                       lossless=True)
        return path
    import av
    pix_fmt_override = pix_fmt
    codec, pix_fmt, options = WRITERS[path.suffix]
    h, w = frames[0].shape[:2]
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = w, h, pix_fmt_override or pix_fmt
        stream.options = options
        for a in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def make_video_dataset(folder: Path) -> Path:
    """Clips of 9-17 frames in four formats at four frame rates, and two still images, captioned."""
    folder.mkdir(parents=True, exist_ok=True)
    clips = [("clip_mp4.mp4", 17, 16, (220, 40, 40)), ("clip_webm.webm", 20, 24, (40, 180, 60)),
             ("clip_gif.gif", 12, 20, (40, 70, 220)), ("clip_webp.webp", 10, 10, (230, 210, 40))]
    for name, count, fps, rgb in clips:
        write_video(folder / name, moving_square(count, rgb=rgb), fps)
        (folder / name).with_suffix(".txt").write_text(f"a square moving right, {name.split('_')[1]}")
    for i, rgb in enumerate([(220, 40, 40), (40, 70, 220)]):
        Image.fromarray(moving_square(1, rgb=rgb)[0]).save(folder / f"still{i}.png")
        (folder / f"still{i}.txt").write_text("a square")
    return folder
