"""The GPU caching case (bench/caching.py) runs its whole code path on the CPU with the shared micro Flux files:
the cache job and the bare loop both encode, and their rates and ratios come back as JSON."""
import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_caching_case_runs_on_the_cpu(tmp_path, warm_bench_ranks):
    out = subprocess.run([sys.executable, "-m", "pipetrain.bench.caching", "--size", "micro", "--resolution", "64",
                          "--images", "4", "--batch", "2", "--short-captions", "--work", str(tmp_path / "work"),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "caching.json").read_text())
    ours, bare = result["pipetrain"], result["bare"]
    # the first batch and caption are left out of every rate: 2 of 4 pictures, 3 of 4 captions timed
    assert (ours["latents"]["timed"], ours["latents"]["total"], ours["texts"]["timed"]) == (2, 4, 3), ours
    assert (bare["latents"]["timed"], bare["texts"]["timed"], bare["texts_float32"]["timed"]) == (2, 3, 3), bare
    assert bare["texts_float32_dtype"] == "float32"
    for name, ratio in result["ratios"].items():
        assert ratio > 0, name
    assert [p.name for p in (tmp_path / "work").iterdir()] == []     # the job folder is deleted; micro files shared
