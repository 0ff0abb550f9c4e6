"""bench/multi_gpu.py's code paths on CPU ranks (gloo): the equivalence and pipeline-efficiency cases through the
real trainer on the micro Flux, and a case killed at its timeout (its ranks with it) while the next one still runs.
The figures come from a machine with several GPUs; here the JSON and its arithmetic are checked."""
import json
import subprocess
import sys

import pytest

from conftest import share_model_files
from pipetrain.bench import multi_gpu as mg


def _harness(tmp_path, *args: str, timeout: float = 1500) -> dict:
    out = subprocess.run([sys.executable, "-m", "pipetrain.bench.multi_gpu", "--device", "cpu", "--size", "micro",
                          "--gpus", "2", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), *args],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((tmp_path / "out" / "multi_gpu.json").read_text())


@pytest.mark.slow
def test_equivalence_and_pipeline_efficiency_cases_run_through_the_trainer(tmp_path, warm_bench_ranks,
                                                                           micro_flux_files):
    # the speed cases train on the suite's micro Flux: writing a fresh 1.1 GB copy cost more than a run here, and
    # test_bench_report.py's tiny cases run write_models' writing
    share_model_files(tmp_path / "work", "flux-micro", micro_flux_files)
    # one timed step a speed case, none left out as warm-up: what is checked is that a rate comes back and the
    # arithmetic on it, for any number of steps (each is 8 micro-batches); the equivalence keeps its 2 steps
    report = _harness(tmp_path, "--cases", "equiv-stages,flux-1024-1stage-ga8,flux-1024-2stages-ga8",
                      "--steps", "1", "--warmup", "0", "--equiv-steps", "2")
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


@pytest.mark.alone
def test_a_case_past_its_timeout_is_killed_with_its_ranks_and_the_next_still_runs(tmp_path):
    """The trainer's launcher and ranks run under the case's process (not in a session of their own), so the
    harness's kill at the timeout takes them too. Each case trains long enough (300 steps per run) that no machine
    finishes it inside the timeout: a fast one once did at the default 3 steps, and nothing was killed. A real
    launch (the launcher's process tree is what is killed). The timeout only has to outlast the case's way to its
    first run (its process's start, its imports and dataset: a few seconds, and this test runs alone), not the
    run: the kill must find the launcher and its ranks starting or training, either way."""
    report = _harness(tmp_path, "--cases", "equiv-stages,equiv-dp", "--equiv-steps", "300", "--case-timeout-s", "10",
                      timeout=300)
    for name in ("equiv-stages", "equiv-dp"):
        case = report["cases"][name]
        assert (case.get("rc"), case.get("error")) == (124, "timed out after 10 s"), case
        assert case["wall_s"] < 90
        assert "run_log_tail" in case, case                           # the trainer had started when it was killed
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "work")], capture_output=True, text=True)
    assert leftover.stdout == ""                                     # no rank of a killed case lives on


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(__import__("torch").cuda.device_count() < 2, reason="two GPUs: NCCL between stages")
def test_two_stages_on_two_gpus_equal_one_stage_and_each_rank_reports_its_peak(tmp_path):
    """On GPUs (NCCL, bfloat16): the equivalence within its bf16 tolerance, and the micro Flux speed pair's memory
    event lists both stages' peaks."""
    out = subprocess.run([sys.executable, "-m", "pipetrain.bench.multi_gpu", "--size", "micro", "--gpus", "2",
                          "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--steps", "3",
                          "--warmup", "1", "--cases", "equiv-stages,flux-1024-1stage-ga8,flux-1024-2stages-ga8"],
                         capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "multi_gpu.json").read_text())
    equiv = report["cases"]["equiv-stages"]
    assert equiv["passed"] and equiv["tolerance"] == mg.TOLERANCE["cuda"], equiv
    peaks = report["cases"]["flux-1024-2stages-ga8"]["peak_gib_per_rank"]
    assert len(peaks) == 2 and all(p > 0 for p in peaks)
    assert len(report["cases"]["flux-1024-1stage-ga8"]["peak_gib_per_rank"]) == 1


@pytest.mark.slow
def test_a_timed_run_stops_at_the_event_asked_for_with_every_rank(tmp_path, micro_flux_files):
    """``train_run(stop_after=...)``: the harness stops each run at its ``memory`` event (GPUs only) to skip the final
    saves; here at ``engine``, on two pipeline ranks of a run that would otherwise train 50 epochs."""
    from pipetrain.backend.commands.demo import make_dataset, write_configs
    from pipetrain.bench.run import train_run

    make_dataset(tmp_path / "dataset", 4)
    config = write_configs(tmp_path, micro_flux_files, stages=2, epochs=50, run_name="bench")
    rc, events = train_run(config, 2, tmp_path / "run.log", stop_after="engine", timeout_s=900)
    assert rc == 0 and any(e["type"] == "engine" for e in events)
    assert not any(e["type"] == "done" for e in events)
    assert "[bench] stopped at the engine event" in (tmp_path / "run.log").read_text()
    leftover = subprocess.run(["pgrep", "-f", str(config)], capture_output=True, text=True)
    assert leftover.stdout == ""
