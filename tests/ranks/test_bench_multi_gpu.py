"""bench/multi_gpu.py's code paths on CPU ranks (gloo): the equivalence and pipeline-efficiency cases through the
real trainer on the micro Flux, and a case killed at its timeout (its ranks with it) while the next one still runs.
The figures come from a machine with several GPUs; here the JSON and its arithmetic are checked."""
import json
import subprocess
import sys

import pytest

from pipetrain.bench import multi_gpu as mg


def _harness(tmp_path, *args: str, timeout: float = 1500) -> dict:
    out = subprocess.run([sys.executable, "-m", "pipetrain.bench.multi_gpu", "--device", "cpu", "--size", "micro",
                          "--gpus", "2", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), *args],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((tmp_path / "out" / "multi_gpu.json").read_text())


@pytest.mark.slow
def test_equivalence_and_pipeline_efficiency_cases_run_through_the_trainer(tmp_path):
    report = _harness(tmp_path, "--cases", "equiv-stages,flux-1024-1stage-ga8,flux-1024-2stages-ga8",
                      "--steps", "2", "--warmup", "1", "--equiv-steps", "2")
    cases = report["cases"]
    equiv = cases["equiv-stages"]
    assert equiv["passed"], equiv
    assert equiv["tolerance"] == mg.TOLERANCE["cpu"] and equiv["lora_moved"]
    assert len(equiv["one_stage_1gpu"]["losses"]) == len(equiv["two_stages_2gpus"]["losses"]) == 2
    assert equiv["loss_max_rel"] <= 1e-5 and equiv["lora_max_rel"] <= 1e-4
    one, two = cases["flux-1024-1stage-ga8"], cases["flux-1024-2stages-ga8"]
    assert one["rc"] == two["rc"] == 0 and one["samples_per_s"] > 0 and two["samples_per_s"] > 0
    assert (one["case"]["stages"], two["case"]["stages"], two["case"]["gradient_accumulation"]) == (1, 2, 8)
    e = report["scaling"]["flux-1024-2stages-ga8"]
    assert e["speedup"] == pytest.approx(two["samples_per_s"] / one["samples_per_s"])
    assert e["efficiency"] == pytest.approx(e["speedup"] / (2 * 8 / 9))
    table = (tmp_path / "out" / "multi_gpu.md").read_text()
    assert "| equiv-stages |" in table and f"| flux-1024-2stages-ga8 | 2 | {e['speedup']:.2f}x | 89% |" in table


def test_a_case_past_its_timeout_is_killed_with_its_ranks_and_the_next_still_runs(tmp_path):
    report = _harness(tmp_path, "--cases", "equiv-stages,equiv-dp", "--case-timeout-s", "4", timeout=300)
    for name in ("equiv-stages", "equiv-dp"):
        case = report["cases"][name]
        assert (case["rc"], case["error"]) == (124, "timed out after 4 s"), case
        assert case["wall_s"] < 60
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "work")], capture_output=True, text=True)
    assert leftover.stdout == ""                                     # no rank of a killed case lives on
