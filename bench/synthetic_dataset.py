"""A synthetic captioned image dataset written fast: real, decodable PNG and JPEG files of varied sizes and aspect
ratios (solid colours, so a 2-megapixel picture is a few kilobytes), each with its caption file.

Every picture of one size and format is the same encoded template with its own number written into a comment
(a PNG ``tEXt`` chunk, a JPEG ``COM`` segment), so every file has its own bytes (its own cache key) and the
writing costs one ``write`` per file. Some JPEGs carry an EXIF orientation that turns them a quarter, as camera
pictures do, so the displayed size differs from the stored one.
"""
from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

# (width, height) as stored: a spread of aspect ratios (about 0.4 to 2.5) and areas (0.3 to 2 megapixels)
SIZES = [(w, h) for w, h in ((512, 1280), (640, 1280), (720, 1280), (768, 1152), (832, 1216), (896, 1152),
                             (960, 1280), (1024, 1024), (1080, 1080), (1152, 896), (1216, 832), (1280, 960),
                             (1280, 720), (1344, 768), (1536, 640), (1600, 640), (1920, 1080), (600, 800),
                             (800, 600), (1200, 1600), (1600, 1200), (1000, 1500), (1500, 1000), (700, 1750))]
PNG_SHARE, ROTATED_SHARE = 0.6, 0.1   # the rest is upright JPEG
EXIF_ORIENTATION_TAG = 0x0112


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_template(width: int, height: int, shade: int) -> tuple[bytes, bytes]:
    """A greyscale PNG of one shade, split before its IEND chunk (a tEXt chunk goes between the halves)."""
    raw = (b"\x00" + bytes([shade]) * width) * height       # filter byte 0, then the row
    head = (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + _png_chunk(b"IDAT", zlib.compress(raw, 9)))
    return head, _png_chunk(b"IEND", b"")


def _jpeg_template(width: int, height: int, shade: int, rotated: bool) -> tuple[bytes, bytes]:
    """A greyscale JPEG of one shade, split after its SOI marker (a COM segment goes between the halves)."""
    from PIL import Image

    picture = Image.new("L", (width, height), shade)     # greyscale: a third of the bytes of colour
    buffer = io.BytesIO()
    exif = Image.Exif()
    if rotated:
        exif[EXIF_ORIENTATION_TAG] = 6
    picture.save(buffer, "JPEG", quality=80, exif=exif.tobytes() if rotated else b"")
    data = buffer.getvalue()
    return data[:2], data[2:]


def _kind(index: int) -> str:
    """'png', 'jpg' or 'rotated', spread evenly over the indices."""
    share = (index * 0.6180339887) % 1.0       # golden-ratio steps: every prefix of the indices holds each share
    return "png" if share < PNG_SHARE else "rotated" if share < PNG_SHARE + ROTATED_SHARE else "jpg"


def caption(index: int) -> str:
    return f"photo {index}, a {('red', 'green', 'blue', 'grey')[index % 4]} square, tag{index % 97}, studio light"


def write_dataset(folder: Path, count: int) -> dict:
    """``count`` pictures (``img000000.png`` ...) and their ``.txt`` captions in ``folder``; returns how many of
    each kind and the displayed size of every picture, by name (for checks)."""
    folder.mkdir(parents=True, exist_ok=True)
    templates: dict[tuple, tuple[bytes, bytes]] = {}
    sizes: dict[str, tuple[int, int]] = {}
    for i in range(count):
        kind = _kind(i)
        width, height = SIZES[i % len(SIZES)]
        key = (kind, width, height)
        if key not in templates:
            templates[key] = (_png_template(width, height, 40 + 7 * len(templates) % 200) if kind == "png"
                              else _jpeg_template(width, height, 40 + 7 * len(templates) % 200, kind == "rotated"))
        head, tail = templates[key]
        tag = f"pipetrain-scale {i}".encode()
        if kind == "png":
            name, data = f"img{i:06d}.png", head + _png_chunk(b"tEXt", b"Comment\x00" + tag) + tail
        else:
            name, data = f"img{i:06d}.jpg", head + b"\xff\xfe" + struct.pack(">H", len(tag) + 2) + tag + tail
        (folder / name).write_bytes(data)
        (folder / name).with_suffix(".txt").write_text(caption(i))
        sizes[name] = (height, width) if kind == "rotated" else (width, height)
    return sizes
