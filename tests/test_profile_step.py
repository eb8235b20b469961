"""scripts/profile_step.py's trace arithmetic on a hand-made trace: self time per op (nested
ops subtracted, runtime wrappers left out) and the FFI calls split by program and HLO op."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_step.py"
spec = importlib.util.spec_from_file_location("profile_step", SCRIPT)
profile_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_step)


def event(name: str, ts: float, dur: float, tid: int = 1, **args: str) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


TRACE = [
    event("ThunkExecutor::Execute", 0, 100),  # a wrapper: not an op
    event("while.3", 0, 100),
    event("ffi_call.61", 10, 30, hlo_module="jit_stage_fn", hlo_op="ffi_call.61"),
    event("ffi_call.61", 50, 20, hlo_module="jit_stage_fn", hlo_op="ffi_call.61"),
    event("ffi_call.1", 0, 40, tid=2, hlo_module="jit_sample_fn", hlo_op="ffi_call.1"),
    event("ynn_fusion.7", 80, 10, tid=2),
]


def test_self_times_subtract_nested_ops_and_skip_wrappers() -> None:
    ops = profile_step.op_self_times(TRACE)
    assert ops == {"while": 50, "ffi_call": 90, "ynn_fusion": 10}
    assert profile_step.op_group("ffi_call").startswith("matmul")


def test_ffi_calls_are_split_by_program_and_op() -> None:
    calls = profile_step.ffi_calls(TRACE)
    assert calls == {("jit_stage_fn", "ffi_call.61"): [30, 20], ("jit_sample_fn", "ffi_call.1"): [40]}
