"""``[samples] render = "host"`` without DeepSpeed or a server: global rank 0's side of one epoch's samples
(request -> marker -> announce; no answer -> the run renders them itself and warns; a stop leaves the request
for ComfyUI and a later epoch announces its answer), and the launcher's ``SampleHost`` queueing pending
requests once per ComfyUI process (again after a restart). The host here is ``sampling.fulfil`` on a thread,
the code the "PipeTrain Epoch Samples" node runs; the queue stands in for ComfyUI's prompt queue."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from pipetrain.backend.sampling import host_render as sample_host
from pipetrain.backend.config import load_run_config, save_toml
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.sampling.render import fulfil
from pipetrain.backend.train.epoch_samples import EpochSamples, wait_together
from pipetrain.backend.train.events import RunReporter

PROMPTS = ["a red circle", "a blue square"]


@pytest.fixture
def run(micro_flux_files, make_run, tmp_path):
    """A run directory as the trainer leaves it (run.toml), an epoch LoRA and the reporter."""
    from safetensors.torch import save_file

    def _make(**samples):
        table = {"prompts": PROMPTS, "width": 64, "height": 64, "steps": 2, "render": "host"} | samples
        cfg = load_run_config(make_run(micro_flux_files, images=1, samples=table))
        run_dir = tmp_path / "job" / "output" / "r"
        run_dir.mkdir(parents=True)
        save_toml(cfg.with_absolute_paths(), run_dir / "run.toml")
        lora = run_dir / "loras" / "r-epoch0001.safetensors"
        lora.parent.mkdir()
        save_file({}, str(lora))           # which LoRA does not matter here (test_samples.py checks that)
        return load_run_config(run_dir / "run.toml"), run_dir, RunReporter(run_dir, enabled=True), lora
    return _make


def events(run_dir: Path, type_: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["type"] == type_]


def answer_requests(run_dir: Path, count: int = 1, timeout: float = 120) -> threading.Thread:
    """The host: answer the first ``count`` requests that appear, as the Epoch Samples node does."""
    def host():
        answered, end = set(), time.monotonic() + timeout
        while len(answered) < count and time.monotonic() < end:
            for path in sample_host.pending(run_dir):
                if path not in answered:
                    fulfil(path, renderer="test-host")
                    answered.add(path)
            time.sleep(0.05)
    thread = threading.Thread(target=host, daemon=True)
    thread.start()
    return thread


def test_config_validates_render_and_timeout(run):
    cfg, *_ = run()
    assert (cfg.samples.render, cfg.samples.host_timeout_s) == ("host", 900.0)
    with pytest.raises(ConfigError, match="samples.render"):
        run(render="comfy")
    with pytest.raises(ConfigError, match="samples.host_timeout_s"):
        run(host_timeout_s=0)


def test_host_answer_is_announced(run):
    cfg, run_dir, reporter, lora = run(host_timeout_s=120)
    host = answer_requests(run_dir)
    assert wait_together(EpochSamples(cfg, run_dir, reporter, lora, 1, 4).poll, interval=0.05) == "host"
    host.join(5)
    (request,) = events(run_dir, "sample_request")
    assert request["lora"] == str(lora) and request["epoch"] == 1 and request["prompts"] == 2
    saved = events(run_dir, "sample_saved")
    assert [(e["epoch"], e["step"], e["prompt"], e["renderer"]) for e in saved] == [
        (1, 4, p, "test-host") for p in PROMPTS]
    for e in saved:
        assert Image.open(e["path"]).size == (64, 64) and Path(e["path"]).parent == lora.parent
    marker = sample_host.read_marker(lora)
    assert marker["pid"] == os.getpid() and marker["pngs"] == [e["path"] for e in saved]
    assert not sample_host.requests(run_dir) and not events(run_dir, "warning")   # answered: request withdrawn


def test_no_answer_falls_back_to_the_runs_own_render_and_warns(run):
    cfg, run_dir, reporter, lora = run(host_timeout_s=0.5)
    assert wait_together(EpochSamples(cfg, run_dir, reporter, lora, 1, 4).poll, interval=0.05) == "run"
    (warning,) = events(run_dir, "warning")
    assert "did not render the samples for epoch 1 within 0.5 s" in warning["message"]
    assert "renders them itself" in warning["message"]
    saved = events(run_dir, "sample_saved")
    assert [(e["prompt"], e["renderer"]) for e in saved] == [(p, "run") for p in PROMPTS]
    assert all(Image.open(e["path"]).size == (64, 64) for e in saved)
    marker = sample_host.read_marker(lora)
    assert marker["renderer"] == "run" and marker["pid"] != os.getpid()      # the child process rendered them
    assert not sample_host.pending(run_dir) and not sample_host.requests(run_dir)


def test_a_stop_leaves_the_request_and_a_later_epoch_announces_its_answer(run):
    cfg, run_dir, reporter, lora = run(host_timeout_s=120)
    job = EpochSamples(cfg, run_dir, reporter, lora, 1, 4, stopping=lambda: True)
    assert wait_together(job.poll, interval=0.05) == "stopped"
    assert "left to ComfyUI" in events(run_dir, "warning")[0]["message"]
    assert sample_host.pending(run_dir) == [sample_host.request_path(run_dir, lora)]
    answer_requests(run_dir).join(120)                  # ComfyUI renders it later (e.g. after a restart)
    assert not sample_host.pending(run_dir) and not events(run_dir, "sample_saved")

    lora2 = lora.with_name("r-epoch0002.safetensors")
    lora2.write_bytes(lora.read_bytes())
    host = answer_requests(run_dir)
    assert wait_together(EpochSamples(cfg, run_dir, reporter, lora2, 2, 8).poll, interval=0.05) == "host"
    host.join(5)
    assert [(e["epoch"], e["step"]) for e in events(run_dir, "sample_saved")] == [(1, 4), (1, 4), (2, 8), (2, 8)]
    assert not sample_host.requests(run_dir)


def test_sample_host_queues_each_pending_request_once_per_process(tmp_path):
    from pipetrain.backend.run.folder import RunsRoot
    from pipetrain.launcher.samples import SAMPLES_NODE, SampleHost, request_file

    dirs = RunsRoot(tmp_path / "runs")
    run_dir = dirs.root / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "run.toml").write_text("")
    loras = [tmp_path / "loras" / f"r1-epoch000{i}.safetensors" for i in (1, 2)]
    request = sample_host.write_request(run_dir, loras[0], 1, 4)
    sample_host.write_request(run_dir, loras[1], 2, 8)
    sample_host.write_marker(loras[1], renderer="x", pngs=[])            # epoch 2 answered already

    queued, ready = [], [False]

    def queue(graph):            # ComfyUI's prompt queue; None while it is still loading nodes
        if not ready[0]:
            return None
        queued.append(graph)
        return f"p{len(queued)}"

    host = SampleHost(dirs, queue)
    event = {"type": "sample_request", "request": request["request"]}
    assert host.tick({"r1": [event]}) == []
    ready[0] = True
    assert host.tick({}) == ["p1"] and host.tick({"r1": [event]}) == []
    assert queued == [{"1": {"class_type": SAMPLES_NODE, "inputs": {"run_id": "r1", "request": "r1-epoch0001"}}}]
    assert SampleHost(dirs, queue).tick({}) == ["p2"]                   # a restarted ComfyUI queues it again
    sample_host.write_marker(loras[0], renderer="x", pngs=[])
    assert SampleHost(dirs, queue).tick({}) == []                        # answered: nothing pending
    for bad in ("../r1", "a/b", ""):
        with pytest.raises(Exception, match="invalid sample request"):
            request_file(dirs, "r1", bad)
