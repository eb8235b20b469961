#!/usr/bin/env bash
# The test suite on a busy machine (issue 51): `stress-ng --cpu 2` at normal priority beside
# scripts/test.sh. Arguments go to pytest, e.g. `bash scripts/test_loaded.sh tests/api_server`.
# (Two spinners with the suite under `nice -n 19` in one session starve pytest entirely: the
# scheduler gives nice 19 about 1.5% of a core there.)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v stress-ng >/dev/null || { apt-get update -q >/dev/null 2>&1; apt-get install -y -q stress-ng >/dev/null; }
stress-ng --cpu "${LOAD_CPUS:-2}" --timeout 3h >/dev/null 2>&1 &
load=$!
trap 'kill "$load" 2>/dev/null || true' EXIT
bash scripts/test.sh --durations=30 "$@"
