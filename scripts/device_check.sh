#!/usr/bin/env bash
# One command for a lent GPU or TPU (a few minutes): kernels on the device, the engine on
# random Llama-3-8B-shaped weights with its decode steps beside the roofline, the kernel
# benchmark; one table out (stdout, and $OUT/device_check.md where OUT is set). See
# scripts/device_check.py.
# The machine needs JAX for its accelerator (jax[cuda13] / jax[tpu]) and jaxserve's own
# dependencies: where no registry is reachable, make them here with
# `bash scripts/device_wheels.sh` and carry .whl/; they are installed first.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/jaxserve-site .whl/*.whl
  export PYTHONPATH=/tmp/jaxserve-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # jaxserve from this tree, not installed
exec python3 scripts/device_check.py "$@"
