"""The CPU scale case (bench/scale.py): scanning, bucketing and planning a dataset grow linearly and stay within
bounds, measured at a small size; the synthetic dataset the case writes is read at its pictures' real sizes."""
import time

import pytest

from pipetrain.backend.config import DatasetConfig, DirectoryConfig
from pipetrain.backend.data import scan_dataset


def test_the_scan_reads_every_synthetic_picture_at_its_displayed_size(tmp_path):
    from pipetrain.bench.synthetic_dataset import caption, write_dataset

    sizes = write_dataset(tmp_path, 120)

    items = scan_dataset(DatasetConfig(directory=[DirectoryConfig(str(tmp_path))], on_unreadable="error")).items
    assert {item.path.name: (item.width, item.height) for item in items} == sizes
    assert [item.caption for item in items] == [caption(i) for i in range(120)]
    assert len(set(sizes.values())) > 20 and any(w < h for w, h in sizes.values()) and any(w > h for w, h in
                                                                                          sizes.values())


@pytest.mark.perf
@pytest.mark.alone
def test_scan_and_plan_grow_linearly_and_stay_within_bounds(tmp_path):
    """Each count runs in a fresh process (bench/scale.py's own measurement): CPU time, not wall time, so that
    other work on the machine moves the figures less."""
    from pipetrain.bench.scale import BUCKETS, run_count

    small, large = run_count(500, tmp_path), run_count(2000, tmp_path)

    for result in small, large:
        assert "total_s" in result, result
    assert (large["images"], large["entries"], large["missing_latents"], large["missing_texts"]) == (2000,) * 4
    assert len(large["buckets"]) == BUCKETS
    assert list(tmp_path.iterdir()) == []                                   # the datasets are deleted
    # 4x the pictures cost about 4x the CPU (quadratic work would cost 16x); the small run's fixed costs weigh more
    assert large["cpu_s"] < 5 * small["cpu_s"] + 0.3, (small, large)
    # under what a full decode of each picture costs on this machine (measured here, after: machines and their load
    # differ too much for a figure in seconds): a scan that decoded pixels would cost at least that. The scan's
    # probes run on a thread pool, whose share moves with the machine's load (0.16 to 0.47 of a decode, measured)
    decode_s = _decode_cpu_s_per_picture(tmp_path / "decoded", 200)
    assert large["cpu_s"] / 2000 < 0.75 * decode_s, (large, decode_s)
    assert large["peak_rss_mib"] - large["rss_after_imports_mib"] < 64, large


def _decode_cpu_s_per_picture(folder, count: int) -> float:
    """The baseline: this process's CPU seconds to decode each of ``count`` pictures of the same synthetic dataset
    (every pixel, orientation applied), as a trainer that read pictures to learn their sizes would."""
    from PIL import Image, ImageOps

    from pipetrain.bench.synthetic_dataset import write_dataset

    names = write_dataset(folder, count)
    start = time.process_time()
    for name in names:
        with Image.open(folder / name) as picture:
            ImageOps.exif_transpose(picture).load()
    return (time.process_time() - start) / count
