#!/usr/bin/env bash
# The main job on the embedded default: tiny Flux-architecture model, generated dataset, cache,
# 2-rank DeepSpeed pipeline training, then the epoch LoRA loaded by ComfyUI.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pipetrain demo "$@"
