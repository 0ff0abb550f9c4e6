"""A picture's displayed size read from its header, for the PNG and JPEG files whose bytes are whole: a dataset's
scan would otherwise decode every picture to find the truncated ones."""
from __future__ import annotations

import zlib

from PIL import Image

EXIF_ORIENTATION_TAG = 0x0112
# EXIF orientations 5-8 rotate by 90 or 270 degrees, so the displayed image has width and height swapped.
TRANSPOSING_ORIENTATIONS = {5, 6, 7, 8}


def size_from_header(image: Image.Image) -> tuple[int, int] | None:
    """A PNG or JPEG whose bytes are whole (every PNG chunk's checksum right up to IEND; a JPEG's end-of-image
    marker after its picture data) and whose orientation is in its header: its displayed size, read without
    decoding the pixels (a large dataset's scan would otherwise cost a full decode per picture). None for
    anything else, which is then decoded fully, so an odd file gets Pillow's own verdict."""
    if image.format not in ("PNG", "JPEG", "MPO"):
        return None
    image.fp.seek(0)        # the file Pillow opened: its bytes, without opening it again
    data = image.fp.read()
    if not (_png_is_whole(data) if image.format == "PNG" else _jpeg_is_whole(data)):
        return None
    # A PNG's getexif decodes the pixels to look for metadata after them; _png_is_whole saw there is none,
    # so the header's metadata, which the base class reads, is all there is.
    exif = Image.Image.getexif(image) if image.format == "PNG" else image.getexif()
    width, height = image.size
    return (height, width) if exif.get(EXIF_ORIENTATION_TAG) in TRANSPOSING_ORIENTATIONS else (width, height)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# chunks that carry an orientation (EXIF, or text under the keywords Pillow reads EXIF and XMP from); after the
# pixel data Pillow reads them only when decoding
PNG_TEXT_CHUNKS = {b"tEXt", b"zTXt", b"iTXt"}
PNG_METADATA_KEYWORDS = {b"Raw profile type exif", b"XML:com.adobe.xmp"}


def _png_is_whole(data: bytes) -> bool:
    """Every chunk complete with its checksum right, up to IEND, and no orientation after the pixel data."""
    pos, seen_pixels = len(PNG_SIGNATURE), False
    while pos + 12 <= len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind, end = data[pos + 4:pos + 8], pos + 12 + length
        if end > len(data) or zlib.crc32(data[pos + 4:end - 4]) != int.from_bytes(data[end - 4:end], "big"):
            return False
        if kind == b"IEND":
            return seen_pixels
        seen_pixels = seen_pixels or kind == b"IDAT"
        if seen_pixels and (kind == b"eXIf" or kind in PNG_TEXT_CHUNKS
                            and data[pos + 8:end - 4].split(b"\0", 1)[0] in PNG_METADATA_KEYWORDS):
            return False
        pos = end
    return False


JPEG_START_OF_SCAN, JPEG_END_OF_IMAGE = 0xDA, b"\xff\xd9"
JPEG_STANDALONE_MARKERS = {0x01, *range(0xD0, 0xD8)}     # TEM and RSTn carry no length


def _jpeg_is_whole(data: bytes) -> bool:
    """The header's segments are whole and an end-of-image marker follows the start of the picture data (the
    entropy-coded data escapes every 0xFF byte, so the marker cannot occur inside it)."""
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return False
        marker = data[pos + 1]
        if marker == 0xFF:          # fill byte
            pos += 1
            continue
        if marker in JPEG_STANDALONE_MARKERS:
            pos += 2
            continue
        end = pos + 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker == JPEG_START_OF_SCAN:
            return end <= len(data) and data.find(JPEG_END_OF_IMAGE, end) >= 0
        pos = end
    return False
