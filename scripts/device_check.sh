#!/usr/bin/env bash
# One command for a lent GPU or TPU (a few minutes): kernels on the device, the kernel
# benchmark, the engine on random Llama-3-8B-shaped weights; one table out (stdout, and
# $OUT/device_check.md where OUT is set). See scripts/device_check.py.
# The machine needs JAX for its accelerator (jax[cuda12] / jax[tpu]) and jaxserve's own
# dependencies; where nothing can be downloaded, carry them as wheels and install first.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps -e . 2>/dev/null || echo "note: jaxserve not installed as a package; running from the tree" >&2
exec python3 scripts/device_check.py "$@"
