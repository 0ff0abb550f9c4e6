#!/usr/bin/env bash
# Run the test suite (sets up the machine first when needed).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free before the tests"
exec .venv/bin/python -m pytest -q -ra --durations=25 "$@"
