"""Bucket maths: sizes, aspect-ratio range, assignment, and one sample per item and resolution."""
import math
import re
from pathlib import Path

import pytest

from pipetrain.backend.config import DatasetConfig, DirectoryConfig
from pipetrain.backend.data import MediaItem, Example, assign_bucket, build_examples, make_buckets


def test_square_bucket_when_ar_bucketing_is_off():
    assert make_buckets(512, False, 0.5, 2.0, 7) == [(512, 512)]


def test_seven_buckets_between_half_and_double():
    assert make_buckets(512, True, 0.5, 2.0, 7) == [
        (368, 720), (400, 640), (464, 576), (512, 512), (576, 464), (640, 400), (720, 368)]


@pytest.mark.parametrize("resolution", [256, 512, 768, 1024])
@pytest.mark.parametrize("min_ar, max_ar, count", [(0.5, 2.0, 7), (0.25, 4.0, 9), (0.6, 1.0, 4), (1.0, 1.75, 5)])
def test_buckets_are_multiples_of_16_with_area_and_ratio_in_range(resolution, min_ar, max_ar, count):
    buckets = make_buckets(resolution, True, min_ar, max_ar, count)

    assert buckets == sorted(set(buckets))
    assert 1 <= len(buckets) <= count
    for width, height in buckets:
        assert width % 16 == 0 and height % 16 == 0
        assert abs(width * height / resolution**2 - 1) < 0.1
        # rounding a side to 16 px moves the ratio by at most about 16/side either way
        slack = 1 + 16 / min(width, height)
        assert min_ar / slack <= width / height <= max_ar * slack


def test_both_ends_of_the_ratio_range_are_buckets():
    assert make_buckets(512, True, 0.25, 4.0, 3) == [(256, 1024), (512, 512), (1024, 256)]


def test_buckets_that_round_to_the_same_size_are_deduplicated():
    assert make_buckets(64, True, 0.9, 1.1, 5) == [(64, 64)]


def test_one_ar_bucket_is_the_geometric_middle_of_the_range():
    assert make_buckets(512, True, 0.5, 2.0, 1) == [(512, 512)]
    assert make_buckets(512, True, 1.0, 4.0, 1) == [(720, 368)]


BUCKETS_512 = make_buckets(512, True, 0.5, 2.0, 7)


@pytest.mark.parametrize("size, expected", [
    ((500, 500), (512, 512)),
    ((1000, 500), (720, 368)),
    ((5000, 100), (720, 368)),
    ((100, 5000), (368, 720)),
    ((600, 1000), (400, 640)),
    ((1920, 1080), (720, 368)),
    ((1600, 1000), (640, 400)),
    ((4032, 3024), (576, 464)),
])
def test_assign_bucket_picks_nearest_log_aspect_ratio(size, expected):
    assert assign_bucket(*size, BUCKETS_512) == expected


def test_assign_bucket_distance_is_symmetric_in_log_space():
    # 1:sqrt(2) lies exactly halfway (in log ratio) between 1:1 and 1:2, so the first bucket listed wins
    buckets = [(512, 512), (512, 1024)]
    assert assign_bucket(1000, round(1000 * math.sqrt(2)) - 1, buckets) == (512, 512)
    assert assign_bucket(1000, round(1000 * math.sqrt(2)) + 1, buckets) == (512, 1024)


def item(name: str, width: int, height: int, resolutions=(512,)) -> MediaItem:
    return MediaItem(Path(f"/data/{name}.png"), "", width, height, 1, tuple(resolutions))


def test_build_samples_gives_one_sample_per_item_and_resolution():
    cfg = DatasetConfig(directory=[DirectoryConfig("/data")], enable_ar_bucket=True)
    wide = item("wide", 1600, 1000, resolutions=(256, 512))
    square = item("square", 300, 300)

    assert build_examples(cfg, [wide, square]) == [
        Example(wide, (320, 208)),
        Example(wide, (640, 400)),
        Example(square, (512, 512)),
    ]


def test_build_samples_without_ar_buckets_is_square_at_each_resolution():
    cfg = DatasetConfig(directory=[DirectoryConfig("/data")], enable_ar_bucket=False)
    wide = item("wide", 1920, 1080, resolutions=(256, 1024))

    assert build_examples(cfg, [wide]) == [Example(wide, (256, 256)), Example(wide, (1024, 1024))]


def test_bucket_sides_follow_the_models_spatial_multiple():
    """SDXL, Wan 2.2 5B, LTX-Video and HunyuanImage 2.1 need sides divisible by 32 (16x/32x VAEs, SDXL's two
    UNet downsamplings); the others by 16."""
    sixteen = make_buckets(512, True, 0.5, 2.0, 7)
    thirty_two = make_buckets(512, True, 0.5, 2.0, 7, multiple=32)
    assert any(w % 32 or h % 32 for w, h in sixteen)
    assert all(w % 32 == 0 and h % 32 == 0 for w, h in thirty_two)
    assert make_buckets(1000, False, 1, 1, 1, multiple=32) == [(992, 992)]


def test_ar_buckets_replace_the_spaced_ratios_and_pairs_become_ratios(tmp_path):
    """diffusion-pipe's ar_buckets: the listed ratios (a [w, h] pair is w / h) at each resolution's area."""
    from pipetrain.backend.config import DatasetConfig
    from pipetrain.backend.config.schema import from_dict

    cfg = from_dict(DatasetConfig, {"resolutions": [[1280, 720]], "enable_ar_bucket": True,
                                    "ar_buckets": [1.0, [1216, 832]], "directory": [{"path": "x"}]},
                    file=tmp_path / "dataset.toml")
    assert cfg.resolutions == [960] and cfg.ar_buckets == [1.0, pytest.approx(1216 / 832)]
    assert make_buckets(960, True, 0.5, 2.0, 7, ratios=cfg.ar_buckets) == [(960, 960), (1168, 800)]
    wide = MediaItem(path=tmp_path / "a.png", caption="", num_repeats=1, width=1500, height=1000, resolutions=(960,))
    [sample] = build_examples(cfg, [wide])
    assert sample.bucket == (1168, 800)


def test_size_buckets_give_stills_and_clips_the_nearest_ratio_and_the_longest_clip_that_fits(tmp_path):
    from pipetrain.backend.config import DatasetConfig
    from pipetrain.backend.errors import DatasetError
    from pipetrain.backend.data.buckets import check_frame_buckets
    from pipetrain.backend.config.schema import from_dict

    cfg = from_dict(DatasetConfig, {"size_buckets": [[832, 480, 1], [480, 832], [832, 480, 33], [832, 480, 17],
                                                     [512, 512, 33]], "directory": [{"path": "x"}]},
                    file=tmp_path / "dataset.toml")
    still = MediaItem(path=tmp_path / "a.png", caption="", num_repeats=1, width=1600, height=900, resolutions=(512,))
    portrait = MediaItem(path=tmp_path / "b.png", caption="", num_repeats=1, width=900, height=1600, resolutions=(512,))
    clip = MediaItem(path=tmp_path / "c.mp4", caption="", num_repeats=1, width=1920, height=1080, resolutions=(512,), frames=30, fps=16.0)
    short = MediaItem(path=tmp_path / "d.mp4", caption="", num_repeats=1, width=1920, height=1080, resolutions=(512,), frames=20, fps=16.0)
    buckets = [s.bucket for s in build_examples(cfg, [still, portrait, clip, short], model_fps=16.0)]
    assert buckets == [(832, 480), (480, 832), (832, 480, 17), (832, 480, 17)]
    with pytest.raises(DatasetError, match=r"size_buckets frames \[34\]"):
        check_frame_buckets([], 4, [[832, 480, 34]])


@pytest.mark.parametrize("data,key", [({"size_buckets": [[830, 480]]}, "size_buckets[0]"),
                                      ({"ar_buckets": [0.0]}, "ar_buckets"),
                                      ({"resolutions": [[1280, 720.5]]}, "resolutions[0]")])
def test_bad_explicit_buckets_are_refused_naming_the_key(tmp_path, data, key):
    from pipetrain.backend.config import DatasetConfig
    from pipetrain.backend.errors import ConfigError
    from pipetrain.backend.config.schema import from_dict

    with pytest.raises(ConfigError, match=f"key '{key.replace('[', '.').replace(']', '.')}"):
        from_dict(DatasetConfig, {**data, "directory": [{"path": "x"}]}, file=tmp_path / "dataset.toml")


def test_a_directorys_aspect_ratio_keys_override_the_top_levels_as_in_diffusion_pipe(tmp_path):
    """diffusion-pipe's per-[[directory]] enable_ar_bucket / min_ar / max_ar / num_ar_buckets / ar_buckets: each key a
    directory sets wins over the top level's; ar_buckets (the directory's, else the top level's) wins over the
    spaced ratios. A wide image of each folder, scanned from a dataset file, trains at its folder's bucket."""
    from PIL import Image

    from pipetrain.backend.config import load_dataset_config
    from pipetrain.backend.data import scan_dataset

    for name in ("square", "spaced", "listed", "top"):
        (tmp_path / name).mkdir()
        Image.new("RGB", (300, 100), (10, 200, 10)).save(tmp_path / name / "wide.png")
    (tmp_path / "dataset.toml").write_text(
        "resolutions = [256]\nenable_ar_bucket = false\nmin_ar = 0.5\nmax_ar = 2.0\nnum_ar_buckets = 7\n"
        "[[directory]]\npath = 'square'\n"
        "[[directory]]\npath = 'spaced'\nenable_ar_bucket = true\nmax_ar = 3.0\nnum_ar_buckets = 2\n"
        "[[directory]]\npath = 'listed'\nenable_ar_bucket = true\nar_buckets = [1.0, [1216, 608]]\n"
        "[[directory]]\npath = 'top'\nenable_ar_bucket = true\n")
    cfg = load_dataset_config(tmp_path / "dataset.toml")
    examples = build_examples(cfg, scan_dataset(cfg).items)
    buckets = {e.item.path.parent.name: e.bucket for e in examples}
    assert buckets == {"square": (256, 256),
                       "spaced": (448, 144),   # ratios 0.5 and 3.0 (its max_ar, the top level's min_ar): 3.0
                       "listed": (368, 176),   # its ratios 1.0 and 2.0: 2.0
                       "top": (368, 176)}      # the top level's 0.5..2.0 in 7: 2.0


@pytest.mark.parametrize("line, key", [("min_ar = 1.5", "directory[1].min_ar"), ("max_ar = 0.8", "directory[1].max_ar"),
                                       ("num_ar_buckets = 0", "directory[1].num_ar_buckets"),
                                       ("ar_buckets = [30.0]", "directory[1].ar_buckets"),
                                       ("ar_buckets = [[1216, 608.5]]", "directory[1].ar_buckets[0]"),
                                       ("enable_ar_bucket = 'yes'", "directory[1].enable_ar_bucket")])
def test_a_directorys_bad_aspect_ratio_key_is_refused_naming_the_file_and_key(tmp_path, line, key):
    from pipetrain.backend.config import load_dataset_config
    from pipetrain.backend.errors import ConfigError

    (tmp_path / "dataset.toml").write_text(f"resolutions = [256]\n[[directory]]\npath = 'x'\n"
                                           f"[[directory]]\npath = 'y'\n{line}\n")
    with pytest.raises(ConfigError, match=re.escape(f"dataset.toml: key '{key}'")):
        load_dataset_config(tmp_path / "dataset.toml")


def test_a_directorys_size_buckets_override_the_top_levels_and_their_frames_are_checked(tmp_path):
    """diffusion-pipe's per-[[directory]] size_buckets: that directory's items take its exact sizes, the others the
    top level's buckets; a video model checks the frames of every directory's size_buckets."""
    from PIL import Image

    from pipetrain.backend.config import load_dataset_config
    from pipetrain.backend.data import scan_dataset
    from pipetrain.backend.data.buckets import check_frame_buckets
    from pipetrain.backend.errors import DatasetError

    for name in ("sized", "plain"):
        (tmp_path / name).mkdir()
        Image.new("RGB", (300, 100), (10, 200, 10)).save(tmp_path / name / "wide.png")
    (tmp_path / "dataset.toml").write_text(
        "resolutions = [256]\n[[directory]]\npath = 'sized'\nsize_buckets = [[512, 512], [640, 320], [640, 320, 34]]\n"
        "[[directory]]\npath = 'plain'\n")
    cfg = load_dataset_config(tmp_path / "dataset.toml")
    items = scan_dataset(cfg).items
    assert {e.item.path.parent.name: e.bucket for e in build_examples(cfg, items)} == {"sized": (640, 320),
                                                                                       "plain": (256, 256)}
    with pytest.raises(DatasetError, match=r"size_buckets frames \[34\]"):
        check_frame_buckets(items, 4)
    check_frame_buckets([i for i in items if i.path.parent.name == "plain"], 4)
    (tmp_path / "dataset.toml").write_text("[[directory]]\npath = 'sized'\nsize_buckets = [[500, 512]]\n")
    with pytest.raises(Exception, match=re.escape("dataset.toml: key 'directory[0].size_buckets[0]'")):
        load_dataset_config(tmp_path / "dataset.toml")
