"""scripts/device_check.py keeps working between the rare runs on a lent GPU/TPU: its kernel
checks (interpreted here) and its engine check (tiny random weights) run and pass on the CPU.
The kernel benchmark it also runs has its own test (tests/kernels/test_bench.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
device_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(device_check)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_kernel_checks_pass_interpreted(backend: str) -> None:
    rows = device_check.check_kernels(backend, interpret=True)
    assert len(rows) == len(device_check.KERNEL_CASES)
    assert all(r["attention_ok"] and r["kv_write_ok"] for r in rows), rows


def test_engine_check_serves_dummy_weights_and_times_decode_steps() -> None:
    result, steps = device_check.check_engine(device_check.TINY, smoke=True)
    assert result["batch"] == 8 and result["batch_out_tokens_per_s"] > 0
    assert result["ttft_ms"] > 0 and result["tpot_ms"] > 0
    # Each decode case timed over a full batch, beside its ideal bytes (no chip on a CPU: no
    # roofline column, not a zero).
    assert [(s["batch"], s["context"]) for s in steps] == [(1, 64), (4, 64)]
    assert all(s["step_ms"] > 0 and s["ideal_mb"] > 0 and "roofline_ms" not in s for s in steps)
    assert steps[1]["ideal_mb"] > steps[0]["ideal_mb"]  # four sequences' KV over one's
