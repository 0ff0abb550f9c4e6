# SPDX-License-Identifier: GPL-3.0-or-later
"""A ComfyUI user's first hour (issue 38), through a real server's ``/prompt``: the training template queued
unchanged on the machine it finds (one GPU, simulated where none is present, or only a CPU), Load Epoch LoRA on a
LoRA of another model, the Samples node's defaults. (A Cancel during caching, marked alone, runs on
test_server_e2e.py's server.)"""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from server_fixtures import (REPO, comfy_page, comfy_server, kill_runs, link_model_files, load_example,  # noqa: F401
                             needs_chromium, queued_text, simulate_gpus, workflow_to_prompt)

from pipetrain.backend.run.folder import read_json

IMAGES = 2
SHOTS = REPO / "test-artifacts"


@pytest.fixture(scope="module")
def user(comfy_server):  # noqa: F811
    """The process's shared pinned server (it has the test shims) with the tiny Flux under the names the template
    expects and the template's dataset folder."""
    from pipetrain.backend.commands.demo import make_dataset
    from pipetrain.backend.models.tiny import cached_model_files

    base = comfy_server.base
    files = cached_model_files("flux", "tiny")
    link_model_files(base, files, names={files.diffusion_model: "flux1-dev.safetensors",
                                         files.vae: "ae.safetensors", files.text_encoders[0]: "clip_l.safetensors",
                                         files.text_encoders[1]: "t5xxl_fp16.safetensors"})
    if not (base / "input" / "my_dataset").is_dir():
        make_dataset(base / "input" / "my_dataset", IMAGES)
    return comfy_server


def template_prompt(server, name: str = "train_a_lora", widgets: dict | None = None) -> dict:
    _, object_info = server.get("/object_info")
    return workflow_to_prompt(load_example(name), object_info, widgets=widgets)


# the template as the user has it, at a size this CPU encodes in a moment (the only change)
SMALL = {"1": {"resolutions": "64"}}


@pytest.mark.parametrize("gpus", [1, 0], ids=["one-gpu", "cpu"])
def test_training_template_runs_unchanged_on_this_machine(user, gpus):
    simulate_gpus(user, gpus)
    # a second queue of the same graph would be ComfyUI's cached result: another run name
    text = queued_text(user, template_prompt(user, widgets={**SMALL, "9": {"run_name": f"my_lora_{gpus}"}}), "9",
                       timeout=300)
    run_id = text.split()[2]
    try:
        run = user.runs_root / run_id
        info = read_json(run / "launcher.json")
        assert info["gpus"] == [0], info            # every GPU of the machine: one (or one CPU rank)
        assert "--num_gpus" in info["command"] and info["command"][info["command"].index("--num_gpus") + 1] == "1"
        config = (run / "run.toml").read_text()
        assert "pipeline_stages = 1\n" in config
        # the template's Samples node: each epoch at strength 0 (the base model) and 1, one fixed seed
        samples = tomllib.loads(config)["samples"]
        assert samples["strengths"] == [0.0, 1.0] and samples["seed"] == 0, samples
        assert "pipeline_stages 1 of 1 rank(s)" in text, text
        assert ("on the CPU (1 rank(s))" in text) == (gpus == 0) and ("on GPU(s) [0]" in text) == (gpus == 1), text
    finally:
        user.post(f"/pipetrain/runs/{run_id}/stop", {"kill": True})
        kill_runs(user.runs_root)


def fabricate_lora_run(runs_root, run_id: str, tensors: dict) -> None:
    """A finished run as the launcher lists it, newest of all, whose epoch 1 saved ``tensors`` as its LoRA (the
    files a run writes: its launcher record and the ``lora_saved`` event naming a file in its folder)."""
    import json
    import time

    import torch
    from safetensors.torch import save_file

    from pipetrain.backend.run.folder import RunDir

    run = RunDir(runs_root / run_id)
    run.path.mkdir(parents=True)
    lora = run.path / f"{run_id}-epoch0001.safetensors"
    save_file({k: torch.full(shape, 0.01) for k, shape in tensors.items()}, str(lora))
    run.write_launcher({"id": run_id, "name": run_id, "created": time.time(), "gpus": [0]})
    with open(run.path / "events.jsonl", "a") as f:
        f.write(json.dumps({"type": "lora_saved", "epoch": 1, "step": 2, "path": str(lora), "time": time.time()}) + "\n")


# ComfyUI's names for a rank-1 LoRA on the tiny Flux's first double block's qkv (Flux-dev's width), an SDXL UNet's
# first attention, and a module no model has
FLUX_QKV = {"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": (1, 3072),
            "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": (9216, 1)}
SDXL_ATTN = {"lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight": (1, 640),
             "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_up.weight": (640, 1)}
NOWHERE = {"diffusion_model.no_such_block.lora_A.weight": (1, 8), "diffusion_model.no_such_block.lora_B.weight": (8, 1)}


def epoch_lora_prompt(user) -> dict:
    """The test template as the user has it (run 'newest', epoch 0), rendering 64x64 in one step."""
    from server_fixtures import SHIM_NODE

    _, object_info = user.get("/object_info")
    return workflow_to_prompt(load_example("test_an_epoch_lora"), object_info, replace_types={
        "DualCLIPLoader": SHIM_NODE}, widgets={"7": {"width": 64, "height": 64}, "8": {"steps": 1}})


def test_load_epoch_lora_checks_the_lora_against_the_model_and_says_what_it_loaded(user):
    fabricate_lora_run(user.runs_root, "sdxl-lora", SDXL_ATTN)
    code, body = user.queue(epoch_lora_prompt(user))
    assert code == 200, body
    hist = user.wait_history(body["prompt_id"], timeout=300)
    errors = [m[1] for m in hist["status"]["messages"] if m[0] == "execution_error"]
    assert errors and errors[0]["node_id"] == "4", hist["status"]
    message = errors[0]["exception_message"]
    assert ("run sdxl-lora, epoch 1: sdxl-lora-epoch0001.safetensors applies to none of this model's weights"
            in message and "another base model" in message), message

    fabricate_lora_run(user.runs_root, "flux-lora", {**FLUX_QKV, **NOWHERE})
    code, body = user.queue(epoch_lora_prompt(user))
    assert code == 200, body
    hist = user.wait_history(body["prompt_id"], timeout=300)
    assert hist["status"]["status_str"] == "success", hist["status"]
    text = hist["outputs"]["4"]["text"][0]
    assert text.startswith("loaded run flux-lora, epoch 1: flux-lora-epoch0001.safetensors at strength 1\n"), text
    assert "warning: 2 of 4 tensors of this LoRA do not apply to this model" in text, text


@needs_chromium
def test_samples_seed_stays_fixed_in_the_page(user):
    """The training template in ComfyUI's page: its Samples node has no "control after generate" widget (the
    frontend's default re-randomises a seed at every queue), and the seed is the same after the frontend's
    after-queue step."""
    import asyncio
    import json

    async def drive() -> dict:
        async with comfy_page(user, user.base / "chromium-samples") as page:
            await page.js(f"(async () => {{ await app.loadGraphData({json.dumps(load_example('train_a_lora'))}); "
                          "return true; })()")
            seed = "app.graph.getNodeById(12).widgets.find((w) => w.name === 'seed').value"
            before = await page.js(seed)
            names = await page.js("app.graph.getNodeById(12).widgets.map((w) => w.name)")
            # what the frontend does to every widget once a prompt is queued (a control widget acts here)
            await page.js("(() => { for (const n of app.graph.nodes) for (const w of n.widgets ?? []) "
                          "w.afterQueued?.(); return true; })()")
            await page.screenshot(SHOTS / "train_a_lora-samples.png")
            return {"before": before, "after": await page.js(seed), "names": names}

    out = asyncio.run(asyncio.wait_for(drive(), 300))
    assert out["before"] == out["after"] == 0, out
    assert "control_after_generate" not in out["names"] and out["names"][:4] == [
        "prompts", "negative_prompt", "seed", "width"], out["names"]


def fabricate_stopped_run(runs_root, run_id: str, name: str, created: float, cpu: bool) -> None:
    """A run stopped at step 4 of 20 as its files say it (the launcher's record, the backend's status with the ETA
    it last wrote)."""
    import json

    from pipetrain.backend.run.folder import RunDir

    run = RunDir(runs_root / run_id)
    run.path.mkdir(parents=True)
    run.write_launcher({"id": run_id, "name": name, "created": created, "gpus": [0], "cpu": cpu})
    run.status_file.write_text(json.dumps({"state": "stopped", "step": 4, "total_steps": 20, "eta_s": 120.0,
                                           "started": created}))


@needs_chromium
def test_the_panel_tells_runs_apart_and_follows_the_run_just_queued(user):
    import asyncio
    import json
    import time

    from server_fixtures import card, panel_page

    now = time.time()
    fabricate_stopped_run(user.runs_root, "same-a", "my_lora", now - 7200, cpu=True)
    fabricate_stopped_run(user.runs_root, "same-b", "my_lora", now - 3600, cpu=False)
    simulate_gpus(user, 0)

    async def drive() -> dict:
        out = {}
        async with panel_page(user, user.base / "chromium-panel") as page:
            await page.wait_for(f"!!{card('same-a', '.pipetrain-ident')} && !!{card('same-b', '.pipetrain-ident')}",
                                30, "showing both runs")
            out["cards"] = await page.js("Object.fromEntries(['same-a', 'same-b'].map((id) => [id, document"
                                         ".querySelector(`#pipetrain-panel [data-run=\"${id}\"]`).innerText]))")
            await page.screenshot(SHOTS / "panel-same-named-runs.png")
            text = queued_text(user, template_prompt(user, widgets={**SMALL, "9": {"run_name": "followed"}}), "9",
                               timeout=300)
            out["queued"] = text.split()[2]
            out["selected"] = await page.wait_for(
                f"(() => {{ const id = document.querySelector('#pipetrain-panel .pipetrain-run.sel')?.dataset.run; "
                f"return id === {json.dumps(out['queued'])} ? id : null; }})()", 60, "selecting the run just queued")
            await page.screenshot(SHOTS / "panel-follows-queued-run.png")
        return out

    try:
        out = asyncio.run(asyncio.wait_for(drive(), 400))
    finally:
        kill_runs(user.runs_root)
    a, b = out["cards"]["same-a"], out["cards"]["same-b"]
    assert a != b and "same-a" in a and "same-b" in b and "started " in a and "started " in b, (a, b)
    assert "CPU, 1 rank" in a and "GPU 0" in b, (a, b)
    assert "ETA" not in a + b, (a, b)            # stopped: no time left to estimate
    assert out["selected"] == out["queued"]
