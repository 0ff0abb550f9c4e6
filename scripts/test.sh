#!/usr/bin/env bash
# Run the test suite (sets up the machine first when needed).
# The tests run in PIPETRAIN_TEST_WORKERS processes (default 2; 1 runs them in this process), a test file at a time
# each: most of a test's time is one busy core (a rank waits while the other works), so two share two cores well.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free before the tests"
workers=${PIPETRAIN_TEST_WORKERS:-2}
parallel=()
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
start=$(date +%s)
status=0
.venv/bin/python -m pytest -q -ra --durations=25 "${parallel[@]}" "$@" || status=$?
echo "tests: $(( ($(date +%s) - start) / 60 )) min $(( ($(date +%s) - start) % 60 )) s wall, $workers worker(s)"
exit $status
