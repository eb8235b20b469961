"""scripts/bench_kernels.py keeps running (on the CPU: its smoke configuration)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kernels_pallas

ROOT = Path(__file__).resolve().parents[2]


def test_bench_smoke_runs_every_backend() -> None:
    command = [sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), "--smoke",
               "--iters", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "FAILED" not in result.stdout, result.stdout
    for name in kernels_pallas.list_backends():
        assert f" {name} " in result.stdout, result.stdout
