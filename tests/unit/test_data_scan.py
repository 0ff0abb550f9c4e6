"""scan_dataset: images found by trying Pillow, captions, unreadable files, EXIF orientation."""
import logging
from pathlib import Path

import pytest
from PIL import Image

from pipetrain.backend.config import DatasetConfig, DirectoryConfig
from pipetrain.backend.config.dataset import BucketOptions
from pipetrain.backend.data import MediaItem, scan_dataset
from pipetrain.backend.errors import DatasetError

EXIF_ORIENTATION = 0x0112


def write_image(path: Path, size=(40, 20), orientation: int | None = None) -> Path:
    image = Image.new("RGB", size, (200, 10, 10))
    if orientation is None:
        image.save(path)
    else:
        exif = Image.Exif()
        exif[EXIF_ORIENTATION] = orientation
        image.save(path, exif=exif)
    return path


def dataset(*directories: DirectoryConfig, **kwargs) -> DatasetConfig:
    return DatasetConfig(directory=list(directories), **kwargs)


def warnings_from(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_reads_captions_sizes_and_settings_in_sorted_order(tmp_path):
    write_image(tmp_path / "b.png", (40, 20))
    write_image(tmp_path / "a.jpg", (32, 48))
    (tmp_path / "a.txt").write_text("  a red square \n")
    (tmp_path / "b.txt").write_text("wide")

    result = scan_dataset(dataset(DirectoryConfig(str(tmp_path)), resolutions=[256, 512], num_repeats=3))

    assert result.items == [
        MediaItem(tmp_path / "a.jpg", "a red square", 32, 48, 3, (256, 512), buckets=BucketOptions()),
        MediaItem(tmp_path / "b.png", "wide", 40, 20, 3, (256, 512), buckets=BucketOptions()),
    ]
    assert result.missing_captions == []
    assert result.unreadable == []


def test_directory_overrides_repeats_resolutions_and_caption_extension(tmp_path):
    write_image(tmp_path / "a.png")
    (tmp_path / "a.caption").write_text("from .caption")
    (tmp_path / "a.txt").write_text("ignored, and not mistaken for an image")
    directory = DirectoryConfig(str(tmp_path), num_repeats=5, resolutions=[1024], caption_extension=".caption")

    result = scan_dataset(dataset(directory, num_repeats=2, resolutions=[512]))

    assert result.items == [MediaItem(tmp_path / "a.png", "from .caption", 40, 20, 5, (1024,), buckets=BucketOptions())]
    assert result.unreadable == []                 # a.txt is no media file: never opened


def test_relative_directory_resolves_against_dataset_file_location(tmp_path):
    (tmp_path / "images").mkdir()
    write_image(tmp_path / "images" / "a.png")
    (tmp_path / "images" / "a.txt").write_text("x")

    result = scan_dataset(dataset(DirectoryConfig("images"), _base=tmp_path))

    assert [item.path for item in result.items] == [tmp_path / "images" / "a.png"]
    assert result.items[0].path.is_absolute()


def test_missing_captions_give_empty_caption_and_one_warning_listing_them(tmp_path, caplog):
    for name in ("a", "b", "c"):
        write_image(tmp_path / f"{name}.png")
    (tmp_path / "b.txt").write_text("has one")

    with caplog.at_level(logging.WARNING):
        result = scan_dataset(dataset(DirectoryConfig(str(tmp_path))))

    assert [item.caption for item in result.items] == ["", "has one", ""]
    assert result.missing_captions == [tmp_path / "a.png", tmp_path / "c.png"]
    [warning] = warnings_from(caplog)
    assert "2 image(s) have no caption file" in warning
    assert str(tmp_path / "a.png") in warning and str(tmp_path / "c.png") in warning
    assert str(tmp_path / "b.png") not in warning


def test_empty_caption_file_is_not_missing(tmp_path, caplog):
    write_image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("\n")

    with caplog.at_level(logging.WARNING):
        result = scan_dataset(dataset(DirectoryConfig(str(tmp_path))))

    assert result.items[0].caption == ""
    assert result.missing_captions == []
    assert warnings_from(caplog) == []


def test_hidden_files_and_subdirectories_are_ignored(tmp_path):
    write_image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / ".DS_Store").write_bytes(b"junk")
    (tmp_path / "nested").mkdir()
    write_image(tmp_path / "nested" / "deep.png")

    result = scan_dataset(dataset(DirectoryConfig(str(tmp_path))))

    assert [item.path.name for item in result.items] == ["a.png"]
    assert result.unreadable == []


def make_unreadable_files(directory: Path) -> tuple[Path, Path]:
    write_image(directory / "good.png")
    (directory / "good.txt").write_text("ok")
    garbage = directory / "garbage.jpg"
    garbage.write_bytes(b"this is not an image")
    truncated = directory / "truncated.jpg"
    Image.effect_noise((64, 64), 50).convert("RGB").save(truncated, quality=95)
    truncated.write_bytes(truncated.read_bytes()[:600])
    return garbage, truncated


def test_unreadable_files_are_skipped_with_one_warning(tmp_path, caplog):
    garbage, truncated = make_unreadable_files(tmp_path)

    with caplog.at_level(logging.WARNING):
        result = scan_dataset(dataset(DirectoryConfig(str(tmp_path)), on_unreadable="skip"))

    assert [item.path.name for item in result.items] == ["good.png"]
    assert [path for path, _ in result.unreadable] == [garbage, truncated]
    assert result.unreadable[1][1].startswith("OSError: ") and "truncated" in result.unreadable[1][1].lower()
    [warning] = warnings_from(caplog)
    assert "skipping 2 dataset file(s)" in warning
    for path, reason in result.unreadable:
        assert f"{path}: {reason}" in warning


def test_unreadable_files_raise_when_on_unreadable_is_error(tmp_path):
    garbage, truncated = make_unreadable_files(tmp_path)

    with pytest.raises(DatasetError) as raised:
        scan_dataset(dataset(DirectoryConfig(str(tmp_path)), on_unreadable="error"))

    message = str(raised.value)
    assert str(garbage) in message and str(truncated) in message
    assert "Remove or replace these files" in message
    assert "on_unreadable = 'skip'" in message


def test_missing_directory_names_path_and_key(tmp_path):
    missing = tmp_path / "nope"

    with pytest.raises(DatasetError) as raised:
        scan_dataset(dataset(DirectoryConfig(str(missing))))

    assert str(missing) in str(raised.value)
    assert "directory.path" in str(raised.value)


def test_directory_without_images_is_an_error(tmp_path):
    (tmp_path / "only.txt").write_text("a caption without an image")

    with pytest.raises(DatasetError) as raised:
        scan_dataset(dataset(DirectoryConfig(str(tmp_path))))

    assert f"dataset directory {tmp_path} contains no readable images" in str(raised.value)


def test_directory_whose_only_files_are_unreadable_is_an_error(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"\x89PNG nope")

    with pytest.raises(DatasetError, match=r"no readable images \(1 unreadable file\(s\) skipped\)"):
        scan_dataset(dataset(DirectoryConfig(str(tmp_path))))


@pytest.mark.parametrize("suffix", [".jpg", ".png"])
@pytest.mark.parametrize("orientation, expected", [(1, (40, 20)), (3, (40, 20)), (6, (20, 40)), (8, (20, 40))])
def test_exif_orientation_sets_displayed_size(tmp_path, suffix, orientation, expected):
    write_image(tmp_path / f"rotated{suffix}", (40, 20), orientation=orientation)

    [item] = scan_dataset(dataset(DirectoryConfig(str(tmp_path)))).items

    assert (item.width, item.height) == expected


def test_only_media_extensions_are_dataset_files(tmp_path):
    write_image(tmp_path / "a.png")
    write_image(tmp_path / "b.JPEG")
    (tmp_path / "notes.md").write_text("# how I shot these")
    (tmp_path / "meta.json").write_text("{}")
    write_image(tmp_path / "c.png").rename(tmp_path / "c.png.bak")   # an image, but not under a media name

    result = scan_dataset(dataset(DirectoryConfig(str(tmp_path)), on_unreadable="error"))

    assert [item.path.name for item in result.items] == ["a.png", "b.JPEG"]
    assert result.unreadable == []


def decoded_size(path: Path):
    """What a full decode says: the displayed size, or the reason Pillow cannot decode the file (the reference the
    scan's header reading must agree with)."""
    try:
        with Image.open(path) as image:
            image.load()
            turned = image.getexif().get(EXIF_ORIENTATION) in (5, 6, 7, 8)
            return image.size[::-1] if turned else image.size
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def png_chunks(data: bytes) -> list[bytes]:
    """The chunks of a PNG, each with its length, type, data and checksum."""
    chunks, pos = [], 8
    while pos < len(data):
        end = pos + 12 + int.from_bytes(data[pos:pos + 4], "big")
        chunks.append(data[pos:end])
        pos = end
    return chunks


def png_chunk(kind: bytes, body: bytes) -> bytes:
    import zlib
    return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")


def exif_bytes(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    return exif.tobytes()


def odd_and_plain_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(files whose size the scan reads from the header, files it must decode): PNGs and JPEGs of every kind the
    header reading treats differently."""
    import io
    noise = Image.effect_noise((48, 32), 60).convert("RGB")
    plain, odd = [], []

    def save(name: str, data: bytes, whole: bool) -> None:
        (folder / name).write_bytes(data)
        (plain if whole else odd).append(folder / name)

    def encoded(fmt: str, **options) -> bytes:
        buffer = io.BytesIO()
        noise.save(buffer, fmt, **options)
        return buffer.getvalue()

    png = encoded("PNG")
    head, *rest = png_chunks(png)
    iend = rest.pop()
    save("plain.png", png, True)
    save("exif-first.png", encoded("PNG", exif=exif_bytes(6)), True)        # Pillow writes eXIf before the pixels
    save("comment-after.png", png[:8] + head + b"".join(rest) + png_chunk(b"tEXt", b"Comment\0hi") + iend, True)
    save("exif-after.png", png[:8] + head + b"".join(rest) + png_chunk(b"eXIf", exif_bytes(6)[6:]) + iend, False)
    xmp = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
           b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="8"/></rdf:RDF></x:xmpmeta>')
    save("xmp-after.png", png[:8] + head + b"".join(rest)
         + png_chunk(b"iTXt", b"XML:com.adobe.xmp\0\0\0\0\0" + xmp) + iend, False)
    bad = bytearray(png)
    bad[len(png) // 2] ^= 0xFF
    save("bad-checksum.png", bytes(bad), False)
    save("truncated.png", png[:len(png) // 2], False)
    save("no-end.png", png[:-len(iend)], False)
    jpeg = encoded("JPEG", quality=90)
    save("plain.jpg", jpeg, True)
    save("progressive.jpg", encoded("JPEG", progressive=True), True)
    save("rotated.jpg", encoded("JPEG", exif=exif_bytes(8)), True)
    save("motion-photo.jpg", jpeg + b"\0\0\0\x18ftypmp42" + bytes(500), True)  # a video appended, as phones do
    save("truncated.jpg", jpeg[:len(jpeg) // 2], False)
    save("no-end.jpg", jpeg[:-2], False)
    save("plain.webp", encoded("WEBP"), False)                                 # other formats: always decoded
    return plain, odd


def test_header_reading_agrees_with_a_full_decode_and_decodes_whatever_is_odd(tmp_path):
    """The scan reads a whole PNG or JPEG's size and orientation from its header (a dataset of 100,000 pictures
    is scanned in seconds); every other file is decoded as before. Both give what a full decode gives."""
    from pipetrain.backend.data.headers import size_from_header
    from pipetrain.backend.data.scan import _probe_size

    plain, odd = odd_and_plain_files(tmp_path)
    for path in plain + odd:
        assert _probe_size(path) == decoded_size(path), path.name
        with Image.open(path) as image:
            header = size_from_header(image)
        assert (header is not None) == (path in plain), path.name
    assert _probe_size(tmp_path / "exif-first.png") == (32, 48)
    assert _probe_size(tmp_path / "exif-after.png") == (32, 48)
    assert _probe_size(tmp_path / "xmp-after.png") == (32, 48)
    assert _probe_size(tmp_path / "rotated.jpg") == (32, 48)
    assert _probe_size(tmp_path / "motion-photo.jpg") == (48, 32)
    for name in ("truncated.png", "truncated.jpg", "bad-checksum.png"):
        assert isinstance(_probe_size(tmp_path / name), str), name
