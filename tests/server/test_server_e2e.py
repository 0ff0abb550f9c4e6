# SPDX-License-Identifier: GPL-3.0-or-later
"""End to end through a real ComfyUI (``--cpu``): both example workflows queued through ``/prompt`` on
the tiny Flux model; training with 2 DeepSpeed CPU ranks in 2 pipeline stages; the queue free while it
trains; ComfyUI restarted mid-run; stop through the route -> checkpoint -> resume through the route;
the panel in headless Chromium following the resumed run (when ``chromium`` is installed); finished
with every epoch LoRA; the newest epoch LoRA changes the sampler output.

One training run serves every test after the first two, so the tests run in file order and each needs the one
before (a test whose predecessor failed skips). The first two, the Train node returning fast on fake SDXL files and
a Cancel during caching, share the server only (they are marked alone too, and a server of their own cost that
phase as much again as the test). The test workflow's DualCLIPLoader is swapped for a test-only
stand-in (``server_fixtures.SHIM_NODE``) because ComfyUI cannot build PipeTrain's tiny text encoders.
Sampled images go to ``test-artifacts/``.
"""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from server_fixtures import (CHART_POINTS_JS, CHROMIUM, REPO, SHIM_NODE, fetch_image, install_test_shims, kill_runs,
                             link_model_files, load_example, panel_page, progress_step_js, queued_text,
                             start_server, workflow_to_prompt)
from test_first_hour import IMAGES as TEMPLATE_IMAGES, SMALL, template_prompt
from test_server_pipetrain import fake_sdxl_files, graph

pytestmark = [pytest.mark.slow, pytest.mark.alone]   # alone: the Train node must answer within seconds

IMAGES = 4            # 64 px, micro batch 1, 1 data-parallel rank: 4 steps per epoch
EPOCHS = 5            # long enough that the stop lands mid-run on a slow machine (it came at step 9 to 11 of 20)
STEPS = IMAGES * EPOCHS
ARTIFACTS = REPO / "test-artifacts"


class Session:
    """The server (replaced on restart) and what the tests learn about the one run."""

    def __init__(self, base):
        self.base = base
        self.server = None
        self.files = None
        self.run_id: str | None = None
        self.base_image = None
        self.stopped_step: int | None = None
        self.finished: bool | None = None

    def need(self, attr: str):
        if getattr(self, attr) is None:
            pytest.skip(f"an earlier test did not provide {attr}")
        return getattr(self, attr)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from pipetrain.backend.commands.demo import make_dataset
    from pipetrain.backend.models.tiny import cached_model_files

    s = Session(tmp_path_factory.mktemp("comfy-e2e"))
    s.files = cached_model_files("flux", "tiny")
    install_test_shims(s.base)
    link_model_files(s.base, s.files)
    make_dataset(s.base / "input" / "tiny_set", IMAGES)
    s.server = start_server(s.base)
    try:
        yield s
    finally:
        if s.server is not None:
            s.server.stop()
        kill_runs(s.base / "output" / "pipetrain")


def run_info(server, run_id: str) -> dict:
    code, run = server.get(f"/pipetrain/runs/{run_id}")
    assert code == 200, run
    return run


def wait_run(server, run_id: str, until, timeout: float, what: str) -> dict:
    """Poll the run route until ``until(run)``; fail with the run and the logs on timeout or failure."""
    end = time.monotonic() + timeout
    run = {}
    while time.monotonic() < end:
        run = run_info(server, run_id)
        if until(run):
            return run
        if run["state"] in ("failed", "killed"):
            break
        time.sleep(0.5)
    log = (server.runs_root / run_id / "log.txt")
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log.exists() else ""
    raise AssertionError(f"run {run_id}: not {what} after {timeout} s: {run}\n--- run log ---\n{tail}")


def events(server, run_id: str, type_: str) -> list[dict]:
    from pipetrain.backend.run.folder import read_events
    found, _ = read_events(server.runs_root / run_id / "events.jsonl")
    return [e for e in found if e.get("type") == type_]


def train_prompt(server, s: Session) -> dict:
    code, info = server.get("/object_info")
    f = s.files
    prompt = workflow_to_prompt(load_example("train_a_lora"), info, widgets={
        "1": {"folder": "tiny_set", "resolutions": "64", "num_ar_buckets": 3},
        "2": {"diffusion_model": f.diffusion_model.name, "text_encoder_1": f.text_encoders[0].name,
              "text_encoder_2": f.text_encoders[1].name, "vae": f.vae.name, "compute_dtype": "float32"},
        "3": {"rank": 4},
        "4": {"lr": 2e-3},
        "5": {"epochs": EPOCHS, "checkpoint_every_n_epochs": 0, "checkpoint_every_n_minutes": 0.0, "seed": 7},
        "6": {"gpus": 2, "pipeline_stages": 2},   # a 2-stage pipeline on 2 ranks (the template's 0s: this machine's)
        # no block's forward computed twice: a third less time a step (the frozen weights take no gradient), and
        # these tests wait on the steps; nothing here is about memory
        "7": {"activation_checkpointing": False},
        "9": {"run_name": "e2e"},
    })
    # no epoch samples: this run trains across a server restart, and the restarted server is the host that would
    # render them (the samples' own end-to-end test is tests/server/test_server_samples.py)
    del prompt["12"], prompt["9"]["inputs"]["samples"]
    return prompt


def sample_prompt(server, s: Session, with_lora: bool) -> dict:
    code, info = server.get("/object_info")
    f = s.files
    prompt = workflow_to_prompt(load_example("test_an_epoch_lora"), info, replace_types={"DualCLIPLoader": SHIM_NODE},
                                widgets={
        "1": {"unet_name": f.diffusion_model.name},
        "2": {"clip_name1": f.text_encoders[0].name, "clip_name2": f.text_encoders[1].name},
        "3": {"vae_name": f.vae.name},
        "5": {"text": "a red circle on a white background"},
        "7": {"width": 64, "height": 64},
        "8": {"steps": 1},   # one sampler step: the LoRA's effect shows already (mean |diff| was ~30 with 2)
    })
    if not with_lora:  # the base model: the sampler takes UNETLoader's model directly
        loader = prompt.pop("4")
        prompt["8"]["inputs"]["model"] = loader["inputs"]["model"]
    return prompt


def generate(server, prompt: dict, timeout: float = 240):
    code, body = server.queue(prompt)
    assert code == 200, body
    hist = server.wait_history(body["prompt_id"], timeout=timeout)
    assert hist["status"]["status_str"] == "success", hist["status"]
    (image,) = hist["outputs"]["10"]["images"]
    return fetch_image(server, image)


def test_train_returns_fast_and_the_run_is_listed(session):
    """The Train node on fake SDXL files (``test_server_pipetrain.graph``) returns within seconds with the run started;
    the run is killed at once (the files cannot train). Here, before the module's run, for this module's server: in
    the alone phase a server of its own cost as much again as the test."""
    server = session.server
    fake_sdxl_files(server.base)
    t0 = time.monotonic()
    code, body = server.queue(graph(run_name="fast"))
    assert code == 200, body
    hist = server.wait_history(body["prompt_id"], timeout=60)
    elapsed = time.monotonic() - t0
    assert hist["status"]["status_str"] == "success", hist["status"]
    text = hist["outputs"]["4"]["text"][0]
    run_id = text.split()[2]
    assert text.startswith("started run fast-") and elapsed < 30, (text, elapsed)
    # the Model node shows the parity verdict of its type on this ComfyUI, as the run will find it
    assert hist["outputs"]["2"]["text"][0].startswith("sdxl on ComfyUI 0.3.75: passes"), hist["outputs"]["2"]
    print(f"\nTrain node: queued -> returned in {elapsed:.2f} s ({text})")
    code, body = server.get(f"/pipetrain/runs/{run_id}")
    assert code == 200 and body["gpus"] == [0]
    # the fake model cannot train: stop it now (kill) and see it gone
    code, body = server.post(f"/pipetrain/runs/{run_id}/stop", {"kill": True})
    assert code in (200, 409), body
    code, body = server.get(f"/pipetrain/runs/{run_id}")
    assert not body["alive"] and body["state"] in ("killed", "failed")
    launcher_json = json.loads((server.runs_root / run_id / "launcher.json").read_text())
    command = launcher_json["command"]   # python -m pipetrain deepspeed: it exits by the run's status
    assert command[2].endswith("__main__.py") and command[3] == "deepspeed" and "deepspeed.launcher.runner" not in command
    assert (server.runs_root / run_id / "log.txt").exists()


def server_children(server) -> list:
    import psutil

    return psutil.Process(server.proc.pid).children(recursive=True)


def test_cancel_during_caching_stops_within_seconds_cleanly(session):
    """ComfyUI's Cancel (``/interrupt``) while the Cache node encodes: the prompt ends as interrupted in seconds
    (no library error), the caching process is gone and reaped, and the cache holds no temporary file. The training
    template with this module's model files, on its server before its run (marked alone too: in that phase a server
    of its own cost as much again as the test)."""
    import psutil

    from pipetrain.backend.commands.demo import make_dataset
    from pipetrain.backend.run.folder import RunsRoot

    user, f = session.server, session.files
    files = {"2": {"diffusion_model": f.diffusion_model.name, "text_encoder_1": f.text_encoders[0].name,
                   "text_encoder_2": f.text_encoders[1].name, "vae": f.vae.name}}
    make_dataset(user.base / "input" / "my_dataset", TEMPLATE_IMAGES)    # the template's folder
    make_dataset(user.base / "input" / "many", 40)
    prompt = template_prompt(user, widgets={**files, "1": {"folder": "many", "resolutions": "512"}})
    code, body = user.queue({k: v for k, v in prompt.items() if k in ("1", "2", "8")})   # Dataset, Model, Cache
    assert code == 200, body
    cache = RunsRoot(user.runs_root).cache
    end = time.monotonic() + 400
    while cache.read_status().get("state") != "caching":    # encoding (the model loaded): Cancel now
        assert time.monotonic() < end, "caching did not start"
        time.sleep(0.2)
    time.sleep(1.0)
    start = time.monotonic()
    user.post("/interrupt")
    hist = user.wait_history(body["prompt_id"], timeout=120)
    took = time.monotonic() - start
    kinds = [m[0] for m in hist["status"]["messages"]]
    assert "execution_interrupted" in kinds and "execution_error" not in kinds, hist["status"]
    assert took < 10, took
    left = [p for p in server_children(user) if p.status() == psutil.STATUS_ZOMBIE or "cache" in " ".join(p.cmdline())]
    assert not left, [(p, p.cmdline()) for p in left]
    temps = [p for p in (user.runs_root / "cache").rglob("*") if p.name.endswith(".tmp")]
    assert not temps, temps
    # and the Cache node caches again as before
    text = queued_text(user, {k: v for k, v in template_prompt(user, widgets={**files, **SMALL}).items()
                              if k in ("1", "2", "8")}, "8", timeout=300)
    assert text.startswith(f"cache ready: {TEMPLATE_IMAGES} entries; "), text


def test_train_workflow_starts_a_run_and_returns(session):
    s, server = session, session.server
    t0 = time.monotonic()
    code, body = server.queue(train_prompt(server, s))
    assert code == 200, body
    hist = server.wait_history(body["prompt_id"], timeout=240)
    queued_to_done = time.monotonic() - t0
    assert hist["status"]["status_str"] == "success", hist["status"]
    cache_text = hist["outputs"]["8"]["text"][0]
    train_text = hist["outputs"]["9"]["text"][0]
    assert cache_text.startswith(f"cache ready: {IMAGES} entries"), cache_text
    assert train_text.startswith("started run e2e-"), train_text
    s.run_id = train_text.split()[2]
    train_s = float(train_text.split(" in ")[1].split()[0])
    print(f"\nqueued train workflow -> done in {queued_to_done:.1f} s (Cache + Train); "
          f"Train node itself: {train_s:.2f} s ({train_text})")
    assert train_s < 10
    run = run_info(server, s.run_id)
    assert run["alive"] and run["gpus"] == [0, 1], run
    assert hist["outputs"]["10"]["text"][0].startswith(s.run_id)          # Run Status on the RUN handle


def test_queue_stays_free_while_the_run_trains(session):
    s, server = session, session.server
    run_id = s.need("run_id")
    wait_run(server, run_id, lambda r: r["state"] == "training", 180, "training")
    s.base_image = generate(server, sample_prompt(server, s, with_lora=False))
    run = run_info(server, run_id)
    assert run["alive"] and run["state"] == "training" and run["step"] < STEPS, run
    assert s.base_image.shape == (64, 64, 3)


def test_run_keeps_training_across_a_comfyui_restart(session):
    s = session
    run_id = s.need("run_id")
    before = run_info(s.server, run_id)
    s.server.stop()
    s.server = start_server(s.base)
    run = run_info(s.server, run_id)
    assert run["alive"] and run["state"] == "training", run
    code, listing = s.server.get("/pipetrain/runs")
    assert run_id in [r["id"] for r in listing["runs"]]
    wait_run(s.server, run_id, lambda r: (r["step"] or 0) > (before["step"] or 0), 120, "past its pre-restart step")
    assert "re-attached to running run(s): " + run_id in s.server.log.read_text()


def test_stop_route_leaves_a_checkpoint(session):
    s, server = session, session.server
    run_id = s.need("run_id")
    assert not events(server, run_id, "checkpoint")        # this schedule checkpoints only on stop and at the end
    code, body = server.post(f"/pipetrain/runs/{run_id}/stop")
    assert code == 200 and body["state"] == "stopping", body
    stopped = wait_run(server, run_id, lambda r: r["state"] == "stopped", 120, "stopped")
    assert not stopped["alive"] and stopped["resumable"], stopped
    assert stopped["step"] < STEPS, f"the run finished before the stop landed: {stopped}"
    print(f"\nstopped at step {stopped['step']}/{STEPS}")
    (ckpt,) = events(server, run_id, "checkpoint")
    assert ckpt["step"] == stopped["step"] and (server.runs_root / run_id / "checkpoints" / "latest").is_file()
    assert not (server.runs_root / run_id / "stop").exists()
    s.stopped_step = stopped["step"]


def test_resume_route_continues_from_the_checkpoint(session):
    s, server = session, session.server
    run_id, stopped_step = s.need("run_id"), s.need("stopped_step")
    code, body = server.post(f"/pipetrain/runs/{run_id}/resume")
    assert code == 200 and body["alive"], body
    code, body = server.post(f"/pipetrain/runs/{run_id}/resume")
    assert code == 409 and "still running" in body["error"], body
    wait_run(server, run_id, lambda r: r["alive"] and (r["step"] or 0) > stopped_step, 180, "training again")
    (resume,) = events(server, run_id, "resume")
    assert resume["step"] == stopped_step


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_panel_follows_the_real_run(session):
    """Headless Chromium on the restarted server: the panel's progress and loss chart move with the
    resumed run's own events, relayed by the launcher."""
    s = session
    run_id = s.need("run_id")
    step = progress_step_js(run_id)

    async def watch() -> dict:
        async with panel_page(s.server, s.base / "chromium-profile") as page:
            # the step label and the chart redraw on separate events: wait for both before taking the baseline
            await page.wait_for(f"{step} > 0 && {CHART_POINTS_JS} > 0", 60, "showing the run's step and loss")
            before = {"step": await page.js(step), "points": await page.js(CHART_POINTS_JS)}
            await page.wait_for(f"{step} > {before['step']} && {CHART_POINTS_JS} > {before['points']}", 90,
                                "moving on with the run")
            shot = await page.screenshot(ARTIFACTS / "pipetrain-panel-real-run.png")
            return {"before": before, "after": await page.js(step), "shot": shot, "exceptions": page.exceptions}

    result = asyncio.run(asyncio.wait_for(watch(), 240))
    assert result["before"]["points"] >= 1 and not [e for e in result["exceptions"] if "pipetrain" in e], result
    print(f"\npanel followed the run from step {result['before']['step']} to {result['after']}; "
          f"screenshot: {result['shot']}")


def test_resumed_run_finishes_with_every_epoch_lora(session):
    s, server = session, session.server
    run_id = s.need("run_id")
    s.need("stopped_step")
    done = wait_run(server, run_id, lambda r: r["state"] == "finished" and not r["alive"], 300, "finished")
    steps = [e["step"] for e in events(server, run_id, "step")]
    assert steps == list(range(1, STEPS + 1)), steps          # no step lost or repeated across stop/resume
    assert done["step"] == STEPS
    # the LoRAs saved before the stop are still listed (the resumed status.json starts afresh)
    assert sorted(x["epoch"] for x in done["loras"]) == list(range(1, EPOCHS + 1)), done["loras"]
    s.finished = True


def test_newest_epoch_lora_changes_the_sampler_output(session):
    s, server = session, session.server
    s.need("finished")
    base = s.need("base_image")
    lora = generate(server, sample_prompt(server, s, with_lora=True))
    from PIL import Image
    ARTIFACTS.mkdir(exist_ok=True)
    Image.fromarray(base).save(ARTIFACTS / "e2e-base-model.png")
    Image.fromarray(lora).save(ARTIFACTS / "e2e-epoch-lora.png")
    diff = abs(lora.astype(int) - base.astype(int))
    print(f"\nLoRA vs base image: max |diff| {diff.max()}, mean {diff.mean():.2f}")
    assert diff.max() > 0 and diff.mean() > 0.5
