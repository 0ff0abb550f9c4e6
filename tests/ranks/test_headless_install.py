# SPDX-License-Identifier: GPL-3.0-or-later
"""Headless after ``pip install .``: the package lands in site-packages, away from any ComfyUI, and finds the one
the user has (the ComfyUI holding the Python's environment, ``COMFYUI_PATH``, the current folder, ``--comfyui``),
saying in one sentence which; with none, the error says how to name one."""
from __future__ import annotations

import os
import shutil
import subprocess

from comfyui_copies import NOT_COPIED, REPO, python_without_pipetrain

COMFYUI = REPO / ".comfyui" / "ComfyUI"


def test_pip_install_then_the_commands_find_the_users_comfyui(tmp_path):
    comfy = tmp_path / "ComfyUI"          # a user's ComfyUI: its files (linked), its own venv inside it
    comfy.mkdir()
    for entry in COMFYUI.iterdir():
        (comfy / entry.name).symlink_to(entry)
    inside = python_without_pipetrain(comfy / "venv")
    outside = python_without_pipetrain(tmp_path / "other-venv")
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*NOT_COPIED))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COMFYUI_PATH")}
    for python in (inside, outside):
        pip = subprocess.run([str(python), "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
                              "--disable-pip-version-check", str(src)], capture_output=True, text=True, env=env)
        assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-2000:]
    shutil.rmtree(src)

    def doctor(python, *args, cwd=tmp_path, **more):
        return subprocess.run([str(python), "-m", "pipetrain", "doctor", "--model-type", "flux", *args], cwd=cwd,
                              capture_output=True, text=True, env={**env, **more}, timeout=600)

    def said(run) -> list[str]:
        return [line for line in run.stderr.splitlines() if line.startswith("pipetrain: ")]

    found = doctor(inside)
    assert found.returncode == 0, found.stderr[-3000:]
    assert said(found) == [f"pipetrain: using the ComfyUI at {comfy} (found through the ComfyUI holding this "
                           "Python's environment)"], found.stderr[-3000:]
    assert f"ComfyUI     0.3.75 at {comfy}" in found.stdout, found.stdout

    lost = doctor(outside)
    assert lost.returncode != 0
    text = lost.stdout + lost.stderr
    assert "ComfyUI not found" in text and "--comfyui PATH or set COMFYUI_PATH" in text, text[-3000:]
    # said before torch or DeepSpeed is imported (seconds of a machine's time, for nothing)
    timed = subprocess.run([str(outside), "-X", "importtime", "-m", "pipetrain", "doctor", "--model-type", "flux"],
                           cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert timed.returncode == lost.returncode and "ComfyUI not found" in timed.stderr, timed.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in timed.stderr.splitlines() if line.startswith("import time")}
    assert "pipetrain" in imported and not imported & {"torch", "deepspeed"}, sorted(imported)

    by_env = doctor(outside, COMFYUI_PATH=str(comfy))
    assert by_env.returncode == 0 and said(by_env) == [
        f"pipetrain: using the ComfyUI at {comfy} (found through COMFYUI_PATH)"], by_env.stderr[-3000:]
    here = doctor(outside, cwd=comfy)
    assert here.returncode == 0 and said(here) == [
        f"pipetrain: using the ComfyUI at {comfy} (found through the current folder)"], here.stderr[-3000:]
