#!/usr/bin/env bash
# The wheels a lent machine without a package registry lacks, for its Python (default 3.12),
# at the versions this environment runs, into .whl/ (ignored by git; `run`'s carry takes it).
# The lent H200 image has jax, flax, transformers, orbax-checkpoint, msgpack, httpx and
# prometheus-client; scripts/device_check.sh installs .whl/ first where it exists.
#   bash scripts/device_wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-3.12}
PACKAGES="fastapi starlette pydantic pydantic-core typing-inspection annotated-types
typing-extensions uvicorn pyzmq gguf llguidance opentelemetry-api"
platforms=()
for n in 17 24 26 27 28 31 34 35 38 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
rm -rf .whl && mkdir .whl
for name in $PACKAGES; do
  version=$(python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
    --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl \
    "$name==$version" 2>&1 | grep -v "^WARNING: Location" || true
done
ls .whl
du -sh .whl
