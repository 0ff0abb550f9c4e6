# SPDX-License-Identifier: GPL-3.0-or-later
"""Epoch samples rendered by the ComfyUI that started the run (``[samples] render = "host"``), through a real
server (``--cpu``) and a real run (micro Flux, 1 DeepSpeed CPU rank): the train workflow with a Samples node
(render on the host) runs to the end; each epoch's PNGs lie beside its LoRA, were rendered by the server
process (the marker's pid; ``/history`` holds the "PipeTrain Epoch Samples" prompts with their images), are
announced in events.jsonl and are served to the panel (``/pipetrain/runs/{id}/samples/{name}``). Then a request
left pending (a run stopped while it waited) is rendered by a restarted ComfyUI."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest
from PIL import Image
from server_fixtures import kill_runs, link_model_files, load_example, start_server, workflow_to_prompt

pytestmark = pytest.mark.slow

EPOCHS = 2
PROMPTS = ["a red circle", "a blue square"]


@pytest.fixture(scope="module")
def session(tmp_path_factory, micro_flux_files):
    from pipetrain.backend.commands.demo import make_dataset

    base = tmp_path_factory.mktemp("comfy-samples")
    link_model_files(base, micro_flux_files)
    make_dataset(base / "input" / "shapes", 2)
    box = {"server": start_server(base), "base": base}
    try:
        yield box
    finally:
        box["server"].stop()
        kill_runs(base / "output" / "pipetrain")


def train_prompt(server, files) -> dict:
    code, info = server.get("/object_info")
    assert code == 200
    prompt = workflow_to_prompt(load_example("train_a_lora"), info, widgets={
        "1": {"folder": "shapes", "resolutions": "64", "num_ar_buckets": 3},
        "2": {"diffusion_model": files.diffusion_model.name, "text_encoder_1": files.text_encoders[0].name,
              "text_encoder_2": files.text_encoders[1].name, "vae": files.vae.name, "compute_dtype": "float32"},
        "3": {"rank": 4},
        "5": {"epochs": EPOCHS, "checkpoint_every_n_epochs": 0, "checkpoint_every_n_minutes": 0.0, "seed": 7},
        "6": {"gpus": 1, "pipeline_stages": 1},
        "9": {"run_name": "samples"},
    })
    prompt["20"] = {"class_type": "PipeTrainSamples", "inputs": {
        "prompts": "\n".join(PROMPTS), "negative_prompt": "", "seed": 3, "width": 64, "height": 64, "steps": 2,
        "cfg": 1.0, "guidance": 3.5, "sampler": "euler", "scheduler": "simple", "render_on": "host ComfyUI"}}
    prompt["9"]["inputs"]["samples"] = ["20", 0]
    return prompt


def read_events(run_dir, type_: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["type"] == type_]


def wait_for(what: str, until, timeout: float, log=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = until()
        if value:
            return value
        time.sleep(0.5)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log and log.exists() else ""
    raise AssertionError(f"not {what} after {timeout} s\n{tail}")


def test_host_renders_every_epochs_samples(session, micro_flux_files):
    from pipetrain.backend.sampling import host_render as sample_host

    server = session["server"]
    code, body = server.queue(train_prompt(server, micro_flux_files))
    assert code == 200, body
    hist = server.wait_history(body["prompt_id"], timeout=240)
    assert hist["status"]["status_str"] == "success", hist["status"]
    run_id = hist["outputs"]["9"]["text"][0].split()[2]
    run_dir = server.runs_root / run_id

    def finished():
        code, run = server.get(f"/pipetrain/runs/{run_id}")
        assert run["state"] not in ("failed", "killed"), run
        return run["state"] == "finished" and not run["alive"]
    wait_for("finished", finished, 300, run_dir / "log.txt")

    assert "render = \"host\"" in (run_dir / "run.toml").read_text()
    loras = [e["path"] for e in read_events(run_dir, "lora_saved")]
    assert len(loras) == EPOCHS
    assert [e["lora"] for e in read_events(run_dir, "sample_request")] == loras
    saved = read_events(run_dir, "sample_saved")
    assert [(e["epoch"], e["prompt"], e["renderer"]) for e in saved] == [
        (epoch, p, "comfyui") for epoch in range(1, EPOCHS + 1) for p in PROMPTS]
    assert not read_events(run_dir, "warning")
    for epoch, lora in enumerate(loras, 1):
        pngs = [e["path"] for e in saved if e["epoch"] == epoch]
        assert all(p.startswith(lora.removesuffix(".safetensors") + "-sample") for p in pngs)
        assert all(Image.open(p).size == (64, 64) for p in pngs)
        marker = sample_host.read_marker(lora)
        assert marker["pid"] == server.proc.pid and marker["renderer"] == "comfyui" and marker["pngs"] == pngs
    assert not sample_host.requests(run_dir)

    code, run = server.get(f"/pipetrain/runs/{run_id}")                   # what the panel shows
    assert [[x["path"] for x in lora["samples"]] for lora in run["loras"]] == [
        [e["path"] for e in saved if e["epoch"] == epoch] for epoch in range(1, EPOCHS + 1)]
    name = run["loras"][0]["samples"][0]["name"]
    with urllib.request.urlopen(f"{server.url}/pipetrain/runs/{run_id}/samples/{name}", timeout=10) as r:
        assert r.status == 200 and r.read()[:8] == b"\x89PNG\r\n\x1a\n"
    assert server.get(f"/pipetrain/runs/{run_id}/samples/run.toml")[0] == 404    # announced PNGs only

    code, history = server.get("/history")
    sampling = [h for h in history.values() if h["prompt"][2]["1"]["class_type"] == "PipeTrainEpochSamples"]
    assert len(sampling) == EPOCHS and all(h["status"]["status_str"] == "success" for h in sampling)
    assert all(len(h["outputs"]["1"]["images"]) == len(PROMPTS) for h in sampling)   # the node's preview
    session.update(run_dir=run_dir, lora=loras[-1])


def test_a_restarted_comfyui_renders_a_pending_request(session):
    """A run stopped while it waited leaves its request; the next ComfyUI queues it at start-up."""
    from pipetrain.backend.sampling import host_render as sample_host

    run_dir, lora = session.get("run_dir"), session.get("lora")
    if run_dir is None:
        pytest.skip("the run of the previous test did not finish")
    session["server"].stop()
    sample_host.marker_path(lora).unlink()
    sample_host.write_request(run_dir, lora, EPOCHS, 0)
    server = session["server"] = start_server(session["base"])
    marker = wait_for("rendered again", lambda: sample_host.read_marker(lora), 120, server.log)
    assert marker["pid"] == server.proc.pid and marker["error"] is None and len(marker["pngs"]) == len(PROMPTS)
    assert sample_host.pending(run_dir) == []
