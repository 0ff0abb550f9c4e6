# SPDX-License-Identifier: GPL-3.0-or-later
"""PipeTrain inside a real ComfyUI server (``--cpu``): node list, input errors, routes, Train."""
from __future__ import annotations

import http.client
import json
import sys
import time

import pytest
from server_fixtures import comfy_server, workflow_to_prompt, write_fake_model, write_images  # noqa: F401  (fixture)

NODES = ["PipeTrainDataset", "PipeTrainModel", "PipeTrainAdapter", "PipeTrainOptimizer", "PipeTrainSchedule",
         "PipeTrainParallelism", "PipeTrainMemory", "PipeTrainCache", "PipeTrainTrain", "PipeTrainRunStatus",
         "PipeTrainStop", "PipeTrainRunControl", "PipeTrainLoadEpochLoRA"]


def fake_sdxl_files(base) -> None:
    """What ``graph`` names, in a server's base folder: fake SDXL model files and an ``input/photos`` dataset."""
    models = base / "models"
    write_fake_model(models / "diffusion_models" / "good_sdxl.safetensors", "sdxl")
    for name in ("sdxl_clip_l.safetensors", "sdxl_clip_g.safetensors"):   # not a name the templates use: the
        # shared server (``comfy_server``) also has the tiny Flux's files linked under those (test_first_hour.py)
        write_fake_model(models / "text_encoders" / name, None)
    write_fake_model(models / "vae" / "vae.safetensors", None)
    write_images(base / "input" / "photos")


@pytest.fixture(scope="module")
def server(comfy_server):  # noqa: F811
    fake_sdxl_files(comfy_server.base)
    write_fake_model(comfy_server.base / "models" / "diffusion_models" / "junk.safetensors", None)
    (comfy_server.base / "input" / "empty").mkdir(exist_ok=True)
    return comfy_server


def graph(folder="photos", dm="good_sdxl.safetensors", gpus=1, stages=1, run_name="t"):
    return {
        "1": {"class_type": "PipeTrainDataset", "inputs": {
            "folder": folder, "resolutions": "64", "enable_ar_bucket": False, "min_ar": 0.5, "max_ar": 2.0,
            "num_ar_buckets": 1, "num_repeats": 1, "caption_extension": ".txt"}},
        "2": {"class_type": "PipeTrainModel", "inputs": {
            "diffusion_model": dm, "text_encoder_1": "sdxl_clip_l.safetensors",
            "text_encoder_2": "sdxl_clip_g.safetensors",
            "vae": "vae.safetensors", "weight_dtype": "default", "compute_dtype": "float32"}},
        "3": {"class_type": "PipeTrainParallelism", "inputs": {
            "gpus": gpus, "pipeline_stages": stages, "micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gpu_ids": ""}},
        "4": {"class_type": "PipeTrainTrain", "inputs": {
            "dataset": ["1", 0], "model": ["2", 0], "parallelism": ["3", 0], "run_name": run_name}},
    }


def node_error(body: dict, node: str) -> str:
    errors = body.get("node_errors", {}).get(node, {}).get("errors", [])
    return " | ".join(f"{e.get('message')}: {e.get('details')}" for e in errors)


def runs(server) -> list[str]:
    root = server.runs_root
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.exists() else []


def test_object_info_lists_every_node_with_tooltips(server):
    code, info = server.get("/object_info")
    assert code == 200
    for name in NODES:
        assert name in info, name
        node = info[name]
        assert node["category"] == "PipeTrain"
        for section in ("required", "optional"):
            for input_name, spec in node["input"].get(section, {}).items():
                assert spec[1].get("tooltip"), f"{name}.{input_name} has no tooltip"
    assert info["PipeTrainTrain"]["output_node"] and info["PipeTrainCache"]["output_node"]
    assert info["PipeTrainTrain"]["output"] == ["PIPETRAIN_RUN"]
    # a node's widgets beyond its essential ones reach the frontend as advanced (folded until asked for)
    dataset = {k: v[1] for section in ("required", "optional") for k, v in info["PipeTrainDataset"]["input"].get(
        section, {}).items()}
    assert [k for k, spec in dataset.items() if not spec.get("advanced")] == [
        "folder", "resolutions", "enable_ar_bucket", "num_repeats", "caption_extension", "frame_buckets",
        "control_folder", "previous"], dataset


@pytest.mark.parametrize("change, node, message", [
    ({"folder": "empty"}, "1", "contains no images"),
    ({"folder": "no/such/folder"}, "1", "does not exist"),
    ({"dm": "missing.safetensors"}, "2", "model file missing.safetensors not found in models/diffusion_models"),
    ({"dm": "junk.safetensors"}, "2", "not a diffusion model of an architecture PipeTrain trains"),
    ({"gpus": 3, "stages": 2}, "3", "pipeline_stages=2 does not divide gpus=3"),
])
def test_bad_input_is_named_on_the_node_and_starts_nothing(server, change, node, message):
    code, body = server.queue(graph(**change))
    assert code == 400, body
    assert message in node_error(body, node), body
    assert runs(server) == []


def test_unknown_run_id_on_nodes(server):
    prompt = {"1": {"class_type": "PipeTrainRunStatus", "inputs": {"run": "no-such-run"}}}
    code, body = server.queue(prompt)
    assert code == 400 and "no-such-run" in node_error(body, "1")
    prompt = {"1": {"class_type": "PipeTrainStop", "inputs": {"run": "../../etc", "kill": False}}}
    code, body = server.queue(prompt)
    assert code == 400 and node_error(body, "1")


def raw(server, method: str, path: str) -> tuple[int, str]:
    """A request with the path exactly as written (no client-side normalisation of ``..``)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.putrequest(method, path, skip_accept_encoding=True)
    conn.putheader("Content-Length", "0")
    conn.endheaders()
    r = conn.getresponse()
    body = r.read().decode(errors="replace")
    conn.close()
    return r.status, body


def fabricate_run(server, run_id: str, state: str, steps: int = 5) -> None:
    d = server.runs_root / run_id
    d.mkdir(parents=True)
    (d / "run.toml").write_text("")
    (d / "status.json").write_text(json.dumps({
        "state": state, "step": steps, "total_steps": 10, "epoch": 1, "epochs": 2, "loss": 0.25, "eta_s": 30,
        "loras": [{"epoch": 1, "step": steps, "path": str(d / "x.safetensors")}]}))
    with open(d / "events.jsonl", "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"type": "step", "time": time.time(), "step": step, "loss": 1.0 / step}) + "\n")


def test_routes_list_get_and_refuse_bad_ids(server):
    fabricate_run(server, "fab-finished", "finished")
    code, body = server.get("/pipetrain/runs")
    assert code == 200
    run = {r["id"]: r for r in body["runs"]}["fab-finished"]
    assert run["state"] == "finished" and run["step"] == 5 and not run["alive"]
    code, body = server.get("/pipetrain/runs/fab-finished")
    assert code == 200 and body["losses"][-1] == [5, 0.2] and len(body["events"]) == 5
    assert server.get("/api/pipetrain/runs/fab-finished")[0] == 200
    assert server.get("/pipetrain/runs/nope")[0] == 404
    assert server.post("/pipetrain/runs/nope/stop")[0] == 404
    code, body = server.post("/pipetrain/runs/fab-finished/stop")
    assert code == 409 and "not running" in body["error"]
    for path in ["/pipetrain/runs/..%2F..%2Fetc%2Fpasswd", "/pipetrain/runs/%2e%2e", "/pipetrain/runs/.cache-jobs",
                 "/pipetrain/runs/cache", "/pipetrain/runs/a%00b"]:
        status, text = raw(server, "GET", path)
        assert status in (400, 404), (path, status, text)
        assert "root:" not in text
    status, _ = raw(server, "POST", "/pipetrain/runs/..%2F..%2Fx/stop")
    assert status in (400, 404)
    status, _ = raw(server, "GET", "/pipetrain/runs/../../../etc/passwd")
    assert status in (400, 404)


def test_stop_route_stops_a_live_run_started_elsewhere(server):
    """A run whose process this ComfyUI did not start (e.g. before a restart) is found from its files."""
    from pipetrain.launcher.procs import spawn
    from pipetrain.backend.run.folder import RunDir

    fabricate_run(server, "fab-live", "training")
    d = server.runs_root / "fab-live"
    child = [sys.executable, "-c", (
        "import json, os, time\n"
        "while not os.path.exists('stop'): time.sleep(0.02)\n"
        "s = json.load(open('status.json')); s.update(state='stopped', last_checkpoint='c')\n"
        "json.dump(s, open('status.json', 'w'))\n")]
    ref = spawn(child, cwd=d, log_path=d / "log.txt", env=None)
    RunDir(d).write_launcher({"id": "fab-live", "gpus": [7], "process": ref.as_dict(), "created": time.time()})
    try:
        code, body = server.get("/pipetrain/runs/fab-live")
        assert code == 200 and body["alive"] and body["state"] == "training"
        code, body = server.post("/pipetrain/runs/fab-live/stop")
        assert code == 200 and body["state"] == "stopping", body
        ref.popen.wait(20)
        code, body = server.get("/pipetrain/runs/fab-live")
        assert body["state"] == "stopped" and not body["alive"]
    finally:
        if ref.popen.poll() is None:
            ref.popen.kill()


def test_web_extension_and_example_workflows_are_served(server):
    status, js = raw(server, "GET", "/extensions/pipetrain/pipetrain.js")
    assert status == 200 and "pipetrain.event" in js
    code, templates = server.get("/workflow_templates")
    assert code == 200 and sorted(templates["pipetrain"]) == ["test_an_epoch_lora", "train_a_lora"]
    status, text = raw(server, "GET", "/api/workflow_templates/pipetrain/train_a_lora.json")
    workflow = json.loads(text)
    types = {n["type"] for n in workflow["nodes"]}
    assert status == 200 and {"PipeTrainDataset", "PipeTrainModel", "PipeTrainCache", "PipeTrainTrain"} <= types
    code, info = server.get("/object_info")
    prompt = workflow_to_prompt(workflow, info)   # every widget value fits its node's schema, by the frontend's rule
    assert prompt["5"]["inputs"]["seed"] == 42 and prompt["5"]["inputs"]["save_every_n_steps"] == 0


def test_images_made_in_the_graph_become_a_dataset_folder_the_dataset_node_takes(server):
    """Two EmptyImage colours batched by ComfyUI's own nodes, captioned one per line: the node writes them under
    the input folder and shows the folder (the same content always gives the same folder: the unit tests); a
    Dataset node accepts it."""
    import numpy as np
    from PIL import Image

    prompt = {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 0xFF0000}},
        "2": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 0x0000FF}},
        "3": {"class_type": "ImageBatch", "inputs": {"image1": ["1", 0], "image2": ["2", 0]}},
        "4": {"class_type": "PipeTrainImagesToDataset", "inputs": {
            "images": ["3", 0], "captions": "a red square\na blue square", "name": "colours"}},
    }
    code, body = server.queue(prompt)
    assert code == 200, body
    done = server.wait_history(body["prompt_id"])
    assert "4" in done["outputs"], (done.get("status"), server.log_tail())
    [text] = done["outputs"]["4"]["text"]
    written = text.split(" (")[0]
    assert written.startswith("pipetrain_datasets/colours-") and text.endswith("(2 images)"), text
    folder = server.base / "input" / written
    colours = {p.with_suffix(".txt").read_text(): tuple(np.asarray(Image.open(p))[0, 0]) for p in folder.glob("*.png")}
    assert colours == {"a red square": (255, 0, 0), "a blue square": (0, 0, 255)}
    # the Dataset node's folder check (what runs at queue time) accepts the written folder
    bad = graph(folder=written, dm="junk.safetensors")
    code, body = server.queue(bad)
    assert code == 400 and "folder" not in node_error(body, "1"), body
