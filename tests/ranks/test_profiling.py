"""PIPETRAIN_PROFILE: which steps it records, what it measures from the profiler's events, and a real run."""
import json
import sys
import time
from types import SimpleNamespace

import pytest
from conftest import train
from torch.autograd import DeviceType

from pipetrain.backend.train.stack_sampler import HostSampler
from pipetrain.backend.train.profiling import ENV, StepProfiler, idle_gaps, kernel_busy_us


def test_the_variable_names_a_folder_and_optionally_the_steps(tmp_path):
    for value, expected in ((f"{tmp_path}", (6, 2)), (f"{tmp_path}:3", (3, 2)), (f"{tmp_path}:3:5", (3, 5))):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(ENV, value)
            profiler = StepProfiler.from_env(0)
            assert (profiler.folder, profiler.first, profiler.steps) == (tmp_path, *expected)
            assert StepProfiler.from_env(1) is None                       # rank 0 only
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, f"{tmp_path}:six")
        with pytest.raises(ValueError, match=rf"{ENV}=.*six.*<folder>\[:first_step\[:steps\]\]"):
            StepProfiler.from_env(0)
        mp.delenv(ENV)
        assert StepProfiler.from_env(0) is None


def _event(kind, start, end, name="k"):
    return SimpleNamespace(device_type=kind, time_range=SimpleNamespace(start=start, end=end), name=name)


def test_busy_time_counts_overlapping_kernels_once_and_gaps_name_the_host_work():
    events = [_event(DeviceType.CUDA, 0, 1000), _event(DeviceType.CUDA, 500, 1500),   # overlap: 1500 busy
              _event(DeviceType.CUDA, 4000, 5000),                                     # 2500 idle before it
              _event(DeviceType.CUDA, 5200, 6000),                                     # 200 idle: under 500
              _event(DeviceType.CPU, 1400, 4100, "engine.step"), _event(DeviceType.CPU, 2000, 3000, "aten::copy_")]
    prof = SimpleNamespace(events=lambda: events)
    assert kernel_busy_us(prof) == 1500 + 1000 + 800
    assert idle_gaps(prof) == [{"ms": 2.5, "host": ["engine.step", "aten::copy_"]}]


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _wait(seconds):
    time.sleep(seconds)


def test_host_sampling_attributes_wall_time_to_the_code_that_took_it():
    with HostSampler(interval_s=0.001) as sampler:
        start = time.perf_counter()
        _spin(0.3)
        spun = time.perf_counter()
        _wait(0.1)
        end = time.perf_counter()
    assert sampler.samples >= 100
    report = sampler.report(wall_s=end - start, steps=2)
    functions = report.split("function (inclusive)")[1].split("\n\n")[0]
    ms = {line.split()[-1]: float(line.split()[0]) for line in functions.strip().splitlines()}
    # per step, each function's share of the measured wall time (a loaded machine oversleeps: measured, not asked)
    spin_ms, wait_ms = (spun - start) * 500, (end - spun) * 500
    assert ms["_spin"] == pytest.approx(spin_ms, rel=0.35) and ms["_wait"] == pytest.approx(wait_ms, rel=0.35), report
    assert ms["test_host_sampling_attributes_wall_time_to_the_code_that_took_it"] >= 0.9 * (spin_ms + wait_ms)
    assert sys.getswitchinterval() == pytest.approx(0.005)                   # restored


@pytest.mark.slow
def test_a_run_records_the_asked_steps_and_reports_them(micro_flux_files, make_run, tmp_path, monkeypatch):
    folder = tmp_path / "profile"
    monkeypatch.setenv(ENV, f"{folder}:2:1")
    config = make_run(micro_flux_files, images=4, epochs=1, stages=1)
    run = train(config, ranks=1)
    assert run.returncode == 0, run.output[-3000:]
    [event] = run.events("profile")
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["steps"] == event["steps"] == 1 and summary["wall_ms_per_step"] > 0
    assert summary["gpu_busy"] == 0 and summary["idle_gaps"] == []                  # no GPU here
    assert "aten::" in (folder / "ops.txt").read_text() and (folder / "trace.json").stat().st_size > 0
    assert event["host_ms_per_step"] > 0
    host = (folder / "host.txt").read_text()                                        # step 3, sampled
    assert "samples over 1 steps" in host and "run_loop" in host and "train_batch" in host, host
    assert len(run.events("step")) >= 3
