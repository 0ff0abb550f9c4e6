"""Video reading for video models: every container format and animated WebP, frame-rate resampling to the
model's rate, frame buckets, images and videos mixed in one dataset, and what is reported."""
import logging

import pytest
import torch
from media import gray_frames, write_video
from PIL import Image

from pipetrain.backend.config import DatasetConfig, DirectoryConfig
from pipetrain.backend.data import EpochPlan, build_examples, scan_dataset
from pipetrain.backend.data.buckets import check_frame_buckets
from pipetrain.backend.data.video import frame_bucket, frames_at_rate, load_video, probe_video
from pipetrain.backend.errors import DatasetError

# (extension, source fps): lossless codecs, so each picked frame shows which source frame it was
FORMATS = [(".mp4", 32), (".mkv", 8), (".webm", 24), (".gif", 20), (".webp", 10)]


def _levels(frames: torch.Tensor) -> list[int]:
    return [round(float(v) * 255) for v in frames[:, 0, 0, 0]]


@pytest.mark.parametrize("ext, fps", FORMATS)
def test_every_format_is_probed_and_resampled_to_the_model_frame_rate(tmp_path, ext, fps):
    """Model frame k is the source frame on screen at k / 16 s: skipped when the source is faster,
    repeated when it is slower."""
    path = write_video(tmp_path / f"clip{ext}", gray_frames(12), fps, pix_fmt="gray" if ext == ".gif" else None)
    info = probe_video(path)
    assert (info.width, info.height, info.frames) == (48, 32, 12) and info.fps == pytest.approx(fps, rel=0.01)
    frames = load_video(path, (48, 32, 5), model_fps=16)
    assert frames.shape == (5, 32, 48, 3) and frames.dtype == torch.float32
    source = [int(k / 16 * fps + 1e-3) for k in range(5)]     # the frame shown at each model frame time
    assert _levels(frames) == pytest.approx([10 + 15 * i for i in source], abs=2)


def test_frames_are_cropped_to_the_bucket_like_images(tmp_path):
    path = write_video(tmp_path / "wide.mp4", gray_frames(9, size=(96, 32)), 16)
    assert load_video(path, (32, 32, 9), 16).shape == (9, 32, 32, 3)


def test_single_frame_files_are_images(tmp_path):
    Image.new("RGB", (40, 30)).save(tmp_path / "still.webp")
    write_video(tmp_path / "one.gif", gray_frames(1), 10)
    assert probe_video(tmp_path / "still.webp") is None and probe_video(tmp_path / "one.gif") is None


def test_frame_counts_and_buckets():
    assert frames_at_rate(17, 16.0, 16) == 17 and frames_at_rate(17, 32.0, 16) == 9
    assert frames_at_rate(5, 8.0, 16) == 9 and frames_at_rate(1, 0.0, 16) == 1
    buckets = [1, 9, 17]
    assert frame_bucket(17, buckets) == 17 and frame_bucket(16, buckets) == 9 and frame_bucket(8, buckets) is None


def _dataset(tmp_path, frame_buckets=(1, 9, 17)) -> DatasetConfig:
    folder = tmp_path / "data"
    folder.mkdir()
    write_video(folder / "long.mp4", gray_frames(17), 16)       # 17 frames at 16 fps -> the 17 bucket
    write_video(folder / "fast.webm", gray_frames(20), 24)      # 13 at 16 fps -> 9
    write_video(folder / "anim.webp", gray_frames(10), 10)      # 15 at 16 fps -> 9
    write_video(folder / "short.mkv", gray_frames(4), 16)       # 4 frames: shorter than every bucket above 1
    Image.new("RGB", (64, 64), (200, 10, 10)).save(folder / "still.png")
    for p in folder.iterdir():
        p.with_suffix(".txt").write_text(p.stem)
    return DatasetConfig(directory=[DirectoryConfig(path=str(folder))], resolutions=[64],
                         frame_buckets=list(frame_buckets))


def test_images_and_videos_mixed_in_one_dataset(tmp_path, caplog):
    ds = _dataset(tmp_path)
    scan = scan_dataset(ds, videos=True)
    frames = {item.path.name: item.frames for item in scan.items}
    assert frames == {"long.mp4": 17, "fast.webm": 20, "anim.webp": 10, "short.mkv": 4, "still.png": 1}
    with caplog.at_level(logging.WARNING):
        examples = build_examples(ds, scan.items, model_fps=16)
    buckets = {s.item.path.name: s.bucket for s in examples}
    assert buckets == {"long.mp4": (64, 64, 17), "fast.webm": (64, 64, 9), "anim.webp": (64, 64, 9),
                       "still.png": (64, 64)}
    assert "short.mkv: 4 frames" in caplog.text                    # left out, named with the reason
    assert EpochPlan(examples, None, 1, 1, 0, 1, seed=0).steps_per_epoch() == 4


def test_an_image_model_reads_videos_as_before(tmp_path):
    """Without a video model the scan is unchanged: Pillow cannot open an mp4 (reported unreadable) and an
    animated WebP is an image (its first frame)."""
    scan = scan_dataset(_dataset(tmp_path))
    assert sorted(i.path.name for i in scan.items) == ["anim.webp", "still.png"]
    assert all(i.frames == 1 for i in scan.items)
    assert sorted(p.name for p, _ in scan.unreadable) == ["fast.webm", "long.mp4", "short.mkv"]


def test_frame_buckets_must_fit_the_model(tmp_path):
    scan = scan_dataset(_dataset(tmp_path, frame_buckets=(1, 8, 17)), videos=True)
    with pytest.raises(DatasetError, match=r"frame_buckets \[8\]: this model trains on clips of 4k \+ 1 frames"):
        check_frame_buckets(scan.items, 4)
    check_frame_buckets(scan.items, 1)


def test_the_epoch_plan_names_video_buckets(tmp_path):
    ds = _dataset(tmp_path)
    examples = build_examples(ds, scan_dataset(ds, videos=True).items, model_fps=16)
    plan = EpochPlan(examples, None, 2, 1, 0, 1, seed=0)
    assert any("64x64, 17 frames" in w for w in plan.warnings())
