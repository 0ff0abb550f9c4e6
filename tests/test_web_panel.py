# SPDX-License-Identifier: GPL-3.0-or-later
"""The PipeTrain panel in a real browser: headless Chromium (Debian's ``chromium``) on a real ComfyUI.

The run is fabricated (a live stand-in process, ``status.json`` and ``events.jsonl`` written by the test)
but everything after the files is the real path: the launcher's relay tails ``events.jsonl`` and sends
``pipetrain.event`` over ComfyUI's websocket; the panel draws progress and the loss chart. Chromium is
driven over the DevTools protocol (``aiohttp``'s websocket client, already a ComfyUI requirement). A
screenshot of the panel is kept in ``test-artifacts/``.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_fixtures import REPO, start_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = REPO / "test-artifacts"
RUN_ID = "ui-run"
TOTAL = 20

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")


# --- a minimal DevTools-protocol client -------------------------------------------------------------
class Page:
    def __init__(self, ws):
        self.ws = ws
        self.next_id = 0
        self.exceptions: list[str] = []

    async def call(self, method: str, **params) -> dict:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), 30)
            if msg.get("method") == "Runtime.exceptionThrown":
                details = msg["params"]["exceptionDetails"]
                self.exceptions.append(json.dumps(details.get("exception", {}).get("description") or details)[:500])
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def js(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float, what: str):
        """Poll ``expression`` in the page until it is truthy; returns its value."""
        end = time.monotonic() + timeout
        value = None
        while time.monotonic() < end:
            value = await self.js(expression)
            if value:
                return value
            await asyncio.sleep(0.2)
        panel = await self.js("document.querySelector('#pipetrain-panel')?.innerText ?? '(no panel)'")
        raise AssertionError(f"page: not {what} after {timeout} s (last value {value!r}); panel:\n{panel}")

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))


def start_chromium(url: str, profile: Path) -> tuple[subprocess.Popen, int]:
    """Headless Chromium on ``url`` with a fresh profile; returns it and its DevTools port."""
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1", "--window-size=1600,1000", url]
    log = open(profile.parent / "chromium.log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    port_file = profile / "DevToolsActivePort"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode}: "
                               f"{(profile.parent / 'chromium.log').read_text(errors='replace')[-3000:]}")
        if port_file.is_file() and port_file.read_text().strip():
            return proc, int(port_file.read_text().split()[0])
        time.sleep(0.1)
    stop_process(proc)
    raise TimeoutError("chromium did not open its DevTools port in 60 s")


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


async def page_ws_url(port: int, url_prefix: str) -> str:
    import aiohttp
    end = time.monotonic() + 30
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < end:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                for target in await r.json():
                    if target.get("type") == "page" and target.get("url", "").startswith(url_prefix):
                        return target["webSocketDebuggerUrl"]
            await asyncio.sleep(0.1)
    raise TimeoutError("no page target in chromium")


# --- the fabricated run --------------------------------------------------------------------------------
class FakeRun:
    """A live stand-in process recorded as the run's process, and the backend's two report files."""

    def __init__(self, runs_root: Path):
        from pipetrain.launcher.procs import spawn
        from pipetrain.launcher.registry import write_launcher_info

        self.dir = runs_root / RUN_ID
        self.dir.mkdir(parents=True)
        (self.dir / "run.toml").write_text("")
        self.status = {"state": "training", "step": 0, "total_steps": TOTAL, "epoch": 1, "epochs": 2,
                       "started": time.time()}
        self.write_status()
        self.event({"type": "start", "world_size": 2, "pipeline_stages": 2})
        self.ref = spawn([sys.executable, "-c", "import time; time.sleep(600)"], cwd=self.dir,
                         log_path=self.dir / "log.txt", env=None)
        write_launcher_info(self.dir, {"id": RUN_ID, "name": "ui run", "gpus": [0, 1], "process": self.ref.as_dict(),
                                       "created": time.time()})

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

    def close(self) -> None:
        self.ref.signal_group(signal.SIGKILL)
        self.ref.popen.wait(5)


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfy-ui")
    settings = base / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True)
    # a first visit would open the template browser over the canvas
    settings.write_text(json.dumps({"Comfy.TutorialCompleted": True}))
    server = start_server(base)
    run = None
    try:
        run = FakeRun(server.runs_root)
        yield server, run, base
    finally:
        if run is not None:
            run.close()
        server.stop()


PROGRESS = f"document.querySelector('#pipetrain-panel [data-run=\"{RUN_ID}\"] .pipetrain-progress')?.textContent"
POINTS = "Number(document.querySelector('#pipetrain-panel canvas.pipetrain-chart')?.dataset.points ?? -1)"
BAR = f"document.querySelector('#pipetrain-panel [data-run=\"{RUN_ID}\"] .pipetrain-bar > div')?.style.width"
STATE = f"document.querySelector('#pipetrain-panel [data-run=\"{RUN_ID}\"] .pipetrain-state')?.textContent"
EPOCHS = "(document.querySelector('#pipetrain-panel .pipetrain-epochs')?.innerText ?? '')"
BUTTON = ("((scope, label) => [...document.querySelectorAll(`#pipetrain-panel ${scope} button`)]"
          ".find((b) => b.textContent === label))")
LOADER = ("(() => { const n = window.app?.graph?.findNodesByType('PipeTrainLoadEpochLoRA')?.[0];"
          " return n ? Object.fromEntries(n.widgets.map((w) => [w.name, w.value])) : null; })()")


async def drive(server, run: FakeRun, profile: Path) -> dict:
    import aiohttp

    browser, port = start_chromium(server.url + "/", profile)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(await page_ws_url(port, server.url), max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Runtime.enable")
                await page.wait_for("!!document.querySelector('.pipetrain-tab-button')", 90,
                                    "showing the PipeTrain sidebar button")
                await page.js("document.querySelector('.pipetrain-tab-button').click()")
                await page.wait_for(PROGRESS, 30, f"listing run {RUN_ID}")
                first = {"progress": await page.js(PROGRESS), "points": await page.js(POINTS)}

                run.steps(1, 6)                      # the relay picks these up from events.jsonl
                await page.wait_for(f"{PROGRESS} === 'step 6/{TOTAL}' && {POINTS} === 6", 20,
                                    "at step 6 with 6 loss points")
                run.steps(7, 12)
                await page.wait_for(f"{PROGRESS} === 'step 12/{TOTAL}' && {POINTS} === 12", 20,
                                    "at step 12 with 12 loss points")
                run.lora(1, 10)
                await page.wait_for(f"{EPOCHS}.includes('epoch 1 (step 10)')", 20, "listing the epoch 1 LoRA")
                later = {"bar": await page.js(BAR), "text": await page.js(
                    "document.querySelector('#pipetrain-panel').innerText")}
                await page.screenshot(ARTIFACTS / "pipetrain-panel.png")

                # the epoch's button puts a Load Epoch LoRA node for it into the graph
                await page.js(f"{BUTTON}('.pipetrain-epochs', 'Add loader node').click()")
                loader = await page.wait_for(LOADER, 10, "showing a Load Epoch LoRA node")
                # Stop goes through the route; the run shows "stopping" until its process is gone
                await page.js(f"{BUTTON}('[data-run=\"{RUN_ID}\"]', 'Stop').click()")
                await page.wait_for(f"{STATE} === 'stopping'", 20, "stopping")
                return {"first": first, "later": later, "loader": loader, "exceptions": page.exceptions}
    finally:
        stop_process(browser)


def test_panel_shows_live_progress_and_loss_chart(ui):
    server, run, base = ui
    result = asyncio.run(asyncio.wait_for(drive(server, run, base / "chromium-profile"), 240))
    assert result["first"] == {"progress": f"step 0/{TOTAL}", "points": 0}, result
    assert result["later"]["bar"] == "60%", result
    text = result["later"]["text"]
    assert "ui run" in text and "training" in text and "ETA 24 s" in text, text
    assert "Stop" in text, text
    assert result["loader"] == {"run": RUN_ID, "epoch": 1, "strength": 1.0}, result["loader"]
    info = json.loads((run.dir / "launcher.json").read_text())
    assert info.get("stop_requested") and (run.dir / "stop").exists()   # the Stop button reached the route
    assert not [e for e in result["exceptions"] if "pipetrain" in e], result["exceptions"]
    shot = ARTIFACTS / "pipetrain-panel.png"
    assert shot.stat().st_size > 10_000
    print(f"\nscreenshot: {shot}")
