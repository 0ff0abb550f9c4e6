#!/usr/bin/env bash
# Run the test suite (sets up the machine first when needed).
# The tests run in PIPETRAIN_TEST_WORKERS processes (default 2; 1 runs them in this process), a test file at a time
# each: most of a test's time is one busy core (a rank waits while the other works), so two share two cores well.
# The tests marked `alone` (they bound wall time or responsiveness) then run one at a time. Arguments (paths, -k, -m)
# give one run of what they select, in the workers.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "disk: $(df -h --output=avail . | tail -1 | tr -d ' ') free before the tests"
workers=${PIPETRAIN_TEST_WORKERS:-2}
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
  # one compute thread a process: torch's default (one per core) in every worker and rank oversubscribes the cores,
  # and the unit tier then took three times as long in two workers as with one thread each
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
fi
# torch.compile's kernels (the compile tests build a few hundred on the CPU, each a C++ compile) kept in the user's
# cache beside the ComfyUI copies: a later run loads them; a fresh machine compiles them once
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pipetrain/inductor}
# compiled Python modules kept there too, in a tree of their own (none beside the sources): every process of the suite
# (ranks, ComfyUI servers, command-line children, the collection's rewritten test modules) reads them instead of
# compiling ComfyUI's, PipeTrain's and the tests' sources again, which an environment that writes none
# (PYTHONDONTWRITEBYTECODE) makes each process do
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/pipetrain/pycache}
rm -rf "${PYTHONPYCACHEPREFIX:?}/tmp"   # the tests' temporary trees' modules (ComfyUI copies): never read again
pytest=(.venv/bin/python -m pytest -q -ra --durations=25)
start=$(date +%s)
took() { echo "$1: $(( ($(date +%s) - $2) / 60 )) min $(( ($(date +%s) - $2) % 60 )) s wall"; }
if [ $# -gt 0 ]; then
  status=0; "${pytest[@]}" "${parallel[@]}" "$@" || status=$?
  took "tests ($workers worker(s))" "$start"
  exit $status
fi
# the first part lists the files that hold tests marked alone (tests/conftest.py, PIPETRAIN_ALONE_FILES): the second
# collects only those (collecting all of tests/ again to find them cost that part 16 s); all of tests/ if none is listed
alone_files=$(mktemp -d)
first=0; PIPETRAIN_ALONE_FILES=$alone_files "${pytest[@]}" "${parallel[@]}" -m "not alone" || first=$?
took "tests not marked alone ($workers worker(s))" "$start"
mapfile -t alone < <(cat "$alone_files"/*.txt 2>/dev/null | sort -u)
rm -rf "$alone_files"
second_start=$(date +%s)
second=0; "${pytest[@]}" -m alone ${alone[@]+"${alone[@]}"} || second=$?
took "tests marked alone (one at a time)" "$second_start"
took "all tests" "$start"
[ $first -eq 0 ] && [ $second -eq 0 ]
