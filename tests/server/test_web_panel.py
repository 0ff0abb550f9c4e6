# SPDX-License-Identifier: GPL-3.0-or-later
"""The PipeTrain panel in a real browser: headless Chromium (Debian's ``chromium``) on a real ComfyUI.

The run is fabricated (a live stand-in process, ``status.json`` and ``events.jsonl`` written by the test)
but everything after the files is the real path: the launcher's relay tails ``events.jsonl`` and sends
``pipetrain.event`` over ComfyUI's websocket; the panel draws progress and the loss chart; its buttons
call the routes. A screenshot of the panel is kept in ``test-artifacts/``. The e2e module watches the
same panel follow a real DeepSpeed run.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from server_fixtures import (CHART_POINTS_JS, REPO, card, comfy_server, comfyui_of,  # noqa: F401  (fixture)
                             needs_chromium, panel_page, progress_js, start_server)

from pipetrain.backend.host.runtime import PINNED_VERSION

ARTIFACTS = REPO / "test-artifacts"
RUN_ID = "ui-run"
TOTAL = 20

pytestmark = needs_chromium


class FakeRun:
    """A live stand-in process recorded as the run's process, and the backend's two report files."""

    def __init__(self, runs_root: Path):
        from pipetrain.launcher.procs import spawn
        from pipetrain.backend.run.folder import RunDir

        self.dir = runs_root / RUN_ID
        self.dir.mkdir(parents=True)
        (self.dir / "run.toml").write_text("")
        self.status = {"state": "training", "step": 0, "total_steps": TOTAL, "epoch": 1, "epochs": 2,
                       "started": time.time()}
        self.write_status()
        self.event({"type": "start", "world_size": 2, "pipeline_stages": 2})
        self.ref = spawn([sys.executable, "-c", "import time; time.sleep(600)"], cwd=self.dir,
                         log_path=self.dir / "log.txt", env=None)
        RunDir(self.dir).write_launcher({"id": RUN_ID, "name": "ui run", "gpus": [0, 1],
                                         "process": self.ref.as_dict(), "created": time.time()})

    def write_status(self) -> None:
        tmp = self.dir / "status.json.tmp"
        tmp.write_text(json.dumps(self.status))
        os.replace(tmp, self.dir / "status.json")

    def event(self, event: dict) -> None:
        with open(self.dir / "events.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), **event}) + "\n")

    def steps(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            loss = 1.0 / step + 0.05 * (step % 3)
            self.event({"type": "step", "step": step, "epoch": 1 + (step - 1) // 10, "loss": loss, "lr": 1e-4,
                        "samples_per_s": 2.0, "total_steps": TOTAL})
            self.status.update(step=step, loss=loss, epoch=1 + (step - 1) // 10, eta_s=(TOTAL - step) * 3.0)
        self.write_status()

    def lora(self, epoch: int, step: int) -> None:
        path = str(self.dir / f"{RUN_ID}-epoch{epoch:04d}.safetensors")
        self.event({"type": "lora_saved", "epoch": epoch, "step": step, "path": path})
        self.status["loras"] = self.status.get("loras", []) + [{"epoch": epoch, "step": step, "path": path}]
        self.write_status()

    def step_sample(self, epoch: int, step: int) -> None:
        """What "Sample now" leaves: a step LoRA and a sample rendered with it."""
        from PIL import Image

        lora = self.dir / f"{RUN_ID}-step{step:08d}.safetensors"
        png = self.dir / f"{RUN_ID}-step{step:08d}-sample00.png"
        Image.new("RGB", (64, 64), (200, 40, 40)).save(png)
        self.event({"type": "step_lora_saved", "epoch": epoch, "step": step, "path": str(lora)})
        self.event({"type": "sample_saved", "epoch": epoch, "step": step, "path": str(png), "prompt": "a red square"})

    def song(self, epoch: int, step: int, prompt: str) -> None:
        """An audio model's sample of the epoch's LoRA: a FLAC as ``sample_audio.save`` writes it, announced."""
        import torch

        from pipetrain.backend.sampling.audio import save

        path = self.dir / f"{RUN_ID}-epoch{epoch:04d}-sample09.flac"
        wave = torch.sin(torch.arange(44100) / 44100 * 2 * torch.pi * 440) * 0.5
        save({"waveform": wave.expand(1, 2, -1), "sample_rate": 44100}, path)
        self.event({"type": "sample_saved", "epoch": epoch, "step": step, "path": str(path), "prompt": prompt,
                    "prompt_index": 9, "strength": 1.0})

    def samples(self, epoch: int, step: int, strengths: list[float], prompts: list[str]) -> None:
        """PNGs beside the epoch's LoRA, announced as the backend does (``train/epoch_samples.EpochSamples.announce``); the
        first strength's are a video model's clips (animated WebP, ``sample_clips.save_clip``)."""
        import torch
        from PIL import Image

        from pipetrain.backend.sampling.clips import save_clip

        for w in strengths:
            for i, prompt in enumerate(prompts):
                clip = w == strengths[0]
                png = self.dir / f"{RUN_ID}-epoch{epoch:04d}-sample{i:02d}-x{w:.2f}.{'webp' if clip else 'png'}"
                if clip:
                    save_clip(torch.linspace(0, 1, 3)[:, None, None, None].expand(3, 32, 32, 3), png, fps=4)
                else:
                    Image.new("RGB", (32, 32), (int(255 * w / 2), 40 * i, 90)).save(png)
                self.event({"type": "sample_saved", "epoch": epoch, "step": step, "path": str(png),
                            "prompt": prompt, "prompt_index": i, "strength": w})

    def close(self) -> None:
        self.ref.signal_group(signal.SIGKILL)
        self.ref.popen.wait(5)


# the pinned ComfyUI's frontend and today's (ComfyUI 0.33, frontend 1.49) where the machine has it
@pytest.fixture(scope="module", params=[PINNED_VERSION, "0.33.0"])
def ui(request, tmp_path_factory):
    comfyui = comfyui_of(request.param)
    base = tmp_path_factory.mktemp(f"comfy-ui-{request.param}")
    # the pinned one: the process's shared server, its runs folder cleared for this module (``comfy_server``)
    shared = request.param == PINNED_VERSION
    server = request.getfixturevalue("comfy_server") if shared else start_server(base, comfyui=comfyui)
    run = None
    try:
        run = FakeRun(server.runs_root)
        yield Shown(server, request.param), run, base
    finally:
        if run is not None:
            run.close()
        if not shared:
            server.stop()


class Shown:
    """A server as this module drives it: the server, and the ComfyUI version its screenshots are named by."""

    def __init__(self, server, version: str):
        self.server, self.version = server, version

    def __getattr__(self, name):
        return getattr(self.server, name)


PROGRESS = progress_js(RUN_ID)
BAR = f"{card(RUN_ID, '.pipetrain-bar > div')}?.style.width"
STATE = f"{card(RUN_ID, '.pipetrain-state')}?.textContent"
EPOCHS = "(document.querySelector('#pipetrain-panel .pipetrain-epochs')?.innerText ?? '')"
BUTTON = ("((scope, label) => [...document.querySelectorAll(`#pipetrain-panel ${scope} button`)]"
          ".find((b) => b.textContent === label))")
CLICK = "((b) => (b ? (b.click(), true) : false))"   # clicks once the button is there
LOADER = ("(() => { const n = window.app?.graph?.findNodesByType('PipeTrainLoadEpochLoRA')?.[0];"
          " return n ? Object.fromEntries(n.widgets.filter((w) => w.serialize !== false)"   # not its status text
          ".map((w) => [w.name, w.value])) : null; })()")
SECOND_LOADER = LOADER.replace("?.[0]", "?.[1]")
GRID = ("(() => { const g = document.querySelector('#pipetrain-panel .pipetrain-grid'); return g ? [...g.children]"
        ".map((row) => [row.dataset.strength, row.querySelectorAll('img').length]) : null; })()")
BEST = "(document.querySelector('#pipetrain-panel .pipetrain-best')?.textContent ?? '')"


# ComfyUI's api reconnects 300 ms after its socket closes; holding WebSocket back keeps it away for as long as a
# restart would, then letting it through makes the real reconnect (and its "reconnected" event) happen
HOLD_SOCKET = """(() => {
  const api = window.comfyAPI.api.api, Real = window.WebSocket;
  window.__ptRealWebSocket = Real;
  window.WebSocket = function (url) {
    const stub = new EventTarget();
    stub.send = () => {}; stub.close = () => {};
    window.__ptStub = stub; window.__ptHeld = true;
    return stub;
  };
  api.socket.close();
})()"""
RELEASE_SOCKET = ("(() => { window.WebSocket = window.__ptRealWebSocket; "
                  "window.__ptStub.dispatchEvent(new Event('close')); })()")


def fabricate_checkpointed(runs_root: Path, run_id: str, state: str) -> None:
    d = runs_root / run_id
    (d / "checkpoints" / "step5").mkdir(parents=True)
    (d / "checkpoints" / "step5" / "pipetrain.json").write_text("{}")   # what marks a checkpoint complete
    (d / "checkpoints" / "latest").write_text("step5")
    (d / "run.toml").write_text("")
    (d / "status.json").write_text(json.dumps({"state": state, "step": 5, "total_steps": 10}))


def shot(server, name: str) -> Path:
    """The screenshot ``name`` of ``server``'s ComfyUI version (the pinned one's under the names the docs show)."""
    return ARTIFACTS / (f"{name}.png" if server.version == PINNED_VERSION else f"{name}-{server.version}.png")


async def drive(server, run: FakeRun, profile: Path) -> dict:
    async with panel_page(server, profile) as page:
        await page.wait_for(PROGRESS, 30, f"listing run {RUN_ID}")
        first = {"progress": await page.js(PROGRESS), "points": await page.js(CHART_POINTS_JS)}

        run.steps(1, 6)                      # the relay picks these up from events.jsonl
        await page.wait_for(f"{PROGRESS} === 'step 6/{TOTAL}' && {CHART_POINTS_JS} === 6", 20,
                            "at step 6 with 6 loss points")
        run.steps(7, 12)
        await page.wait_for(f"{PROGRESS} === 'step 12/{TOTAL}' && {CHART_POINTS_JS} === 12", 20,
                            "at step 12 with 12 loss points")
        await page.js(HOLD_SOCKET)           # the websocket drops and cannot come back (ComfyUI restarting)
        await page.wait_for("window.__ptHeld === true", 10, "a held websocket")
        run.steps(13, 15)                    # relayed to nobody
        await asyncio.sleep(2)               # several relay ticks: the relay has moved past them
        missed = await page.js(CHART_POINTS_JS)
        await page.js(RELEASE_SOCKET)
        await page.wait_for(f"{CHART_POINTS_JS} === 15", 30, "the chart back-filled after the reconnect")
        run.lora(1, 10)
        await page.wait_for(f"{EPOCHS}.includes('epoch 1 (step 10)')", 20, "listing the epoch 1 LoRA")
        later = {"bar": await page.js(BAR),
                 "text": await page.js("document.querySelector('#pipetrain-panel').innerText")}
        await page.screenshot(shot(server, "pipetrain-panel"))

        # the epoch's button puts a Load Epoch LoRA node for it into the graph
        await page.wait_for(f"{CLICK}({BUTTON}('.pipetrain-epochs', 'Add loader node'))", 10, "an Add loader button")
        loader = await page.wait_for(LOADER, 10, "showing a Load Epoch LoRA node")
        # samples at two strengths and a held-out loss: the grid (strength rows, prompt columns), the best epoch,
        # and a strength's button adds a loader at that epoch and strength
        run.samples(1, 10, [0.5, 1.0], ["a cat", "a dog"])
        run.event({"type": "eval", "name": "eval", "epoch": 1, "step": 10, "loss": 0.1234})
        grid = await page.wait_for(f"(({GRID}) || []).length === 2 && {BEST} !== '' && {GRID}", 20,
                                   "a 2-row sample grid and the best epoch")
        await page.wait_for("[...document.querySelectorAll('#pipetrain-panel .pipetrain-grid img')]"
                            ".every((i) => i.complete && i.naturalWidth === 32)", 20, "the grid's images loaded")
        best = await page.js(BEST)
        await page.screenshot(shot(server, "pipetrain-sample-grid"))
        # an audio model's song: a player, whose file the samples route serves
        run.song(1, 10, "rock, guitar")
        song = await page.wait_for(
            "(async () => { const a = document.querySelector('#pipetrain-panel .pipetrain-grid audio'); if (!a) return null;"
            " const r = await fetch(a.src); const b = new Uint8Array(await r.arrayBuffer());"
            " return [r.status, r.headers.get('content-type'), String.fromCharCode(...b.slice(0, 4)), a.controls,"
            " a.title]; })()", 20, "an audio player for the song, served by the samples route")
        await page.wait_for(f"{CLICK}({BUTTON}('.pipetrain-grid', '×0.5'))", 10, "a strength button")
        strength_loader = await page.wait_for(SECOND_LOADER, 10, "a second Load Epoch LoRA node")
        # the run-control buttons reach their routes; the LR typed survives the re-renders of step events
        await page.wait_for(f"{CLICK}({BUTTON}('[data-run=\"{RUN_ID}\"]', 'Save now'))", 10, "a Save now button")
        await page.wait_for(f"!!{BUTTON}('[data-run=\"{RUN_ID}\"]', 'Sample now')", 10, "a Sample now button")
        await page.js(f"{card(RUN_ID, '.pipetrain-lr')}.value = '3e-5'")
        run.steps(16, 16)
        await page.wait_for(f"{PROGRESS} === 'step 16/{TOTAL}'", 20, "at step 16")
        await page.wait_for(f"{CLICK}({BUTTON}('[data-run=\"{RUN_ID}\"]', 'Set LR'))", 10, "a Set LR button")
        await page.wait_for(f"{CLICK}({BUTTON}('[data-run=\"{RUN_ID}\"]', 'Stop after epoch'))", 10,
                            "a Stop after epoch button")
        run.status["stop_after_epoch"] = 2      # what the backend reports once a rank has taken the request
        run.step_sample(2, 17)
        run.steps(17, 17)
        await page.wait_for(f"{card(RUN_ID, '.pipetrain-pending')}?.textContent === 'stops after epoch 2'", 20,
                            "the pending stop after epoch 2")
        step_sample = await page.wait_for(
            "(() => { const i = document.querySelector('#pipetrain-panel .pipetrain-step-samples img');"
            " return i?.complete && i.naturalWidth ? [i.closest('.pipetrain-step-samples').innerText, i.naturalWidth]"
            " : null; })()", 20, "the sample-now image, served by the samples route")
        await page.screenshot(shot(server, "pipetrain-panel-controls"))
        # Stop goes through the route; the run shows "stopping" until its process is gone
        await page.wait_for(f"{CLICK}({BUTTON}('[data-run=\"{RUN_ID}\"]', 'Stop'))", 10, "a Stop button")
        await page.wait_for(f"{STATE} === 'stopping'", 20, "stopping")
        # Kill asks first; answered "no", nothing is sent
        await page.js("window.__ptAsked = []; window.confirm = (m) => (window.__ptAsked.push(m), false)")
        await page.wait_for(f"{CLICK}({BUTTON}('[data-run=\"{RUN_ID}\"]', 'Kill'))", 10, "a Kill button")
        asked = await page.wait_for("window.__ptAsked[0]", 10, "a confirmation")
        # a finished run offers no Resume; a stopped one with a checkpoint does
        for run_id, state in (("ui-finished", "finished"), ("ui-paused", "stopped")):
            fabricate_checkpointed(run.dir.parent, run_id, state)
        await page.js("window.comfyAPI.api.api.dispatchCustomEvent('reconnected')")   # the list reloads
        await page.wait_for(f"!!{BUTTON}('[data-run=\"ui-paused\"]', 'Resume')", 20, "Resume on the stopped run")
        resume_on_finished = await page.js(f"!!{BUTTON}('[data-run=\"ui-finished\"]', 'Resume')")
        return {"first": first, "later": later, "loader": loader, "exceptions": page.exceptions, "missed": missed,
                "grid": grid, "best": best, "strength_loader": strength_loader, "song": song,
                "asked": asked, "resume_on_finished": resume_on_finished, "step_sample": step_sample}


def test_panel_shows_live_progress_and_loss_chart(ui):
    server, run, base = ui
    result = asyncio.run(asyncio.wait_for(drive(server, run, base / "chromium-profile"), 240))
    assert result["first"] == {"progress": f"step 0/{TOTAL}", "points": 0}, result
    assert result["missed"] == 12, result         # the held socket delivered nothing; the reconnect back-filled
    assert result["later"]["bar"] == "75%", result
    text = result["later"]["text"]
    assert "ui run" in text and "training" in text and "ETA 15 s" in text and "Stop" in text, text
    assert result["loader"] == {"run": RUN_ID, "epoch": 1, "strength": 1.0}, result["loader"]
    assert result["grid"] == [["0.5", 2], ["1", 2]], result["grid"]
    assert result["best"] == "Lowest held-out loss: epoch 1 (0.1234)", result["best"]
    assert result["strength_loader"] == {"run": RUN_ID, "epoch": 1, "strength": 0.5}, result["strength_loader"]
    assert shot(server, "pipetrain-sample-grid").stat().st_size > 5_000
    status, kind, magic, controls, title = result["song"]
    assert (status, kind, magic, controls, title) == (200, "audio/flac", "fLaC", True, "rock, guitar (strength 1)"), \
        result["song"]
    info = json.loads((run.dir / "launcher.json").read_text())
    assert info.get("stop_requested") and (run.dir / "stop").exists()   # the Stop button reached the route
    control = run.dir / "control"   # so did the run-control buttons, with the LR typed before a step re-rendered
    assert json.loads((control / "lr.json").read_text())["lr"] == 3e-5
    assert (control / "save.json").is_file() and (control / "stop_after_epoch.json").is_file()
    assert "Kill run ui run now?" in result["asked"] and not info.get("killed") and run.ref.alive(), result
    assert result["resume_on_finished"] is False, result
    assert "step 17 (epoch 2)" in result["step_sample"][0] and result["step_sample"][1] == 64, result
    assert not [e for e in result["exceptions"] if "pipetrain" in e], result["exceptions"]
    panel = shot(server, "pipetrain-panel")
    assert panel.stat().st_size > 10_000 and shot(server, "pipetrain-panel-controls").stat().st_size > 10_000
    print(f"\nscreenshot: {panel}")
