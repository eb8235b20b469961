"""The GPU attention kernel's tunings as the CUDA compiler sees them (no GPU needed).

    python scripts/gpu_tunings.py [--targets h100,h200] [--quick] [--markdown]

Compiles `kernels_pallas`' gpu variant (Pallas -> Triton -> PTX -> ptxas) for compile-only
H100 / H200 devices at Llama-3-8B shapes (32 q heads, 8 KV heads, head dim 128, pages of 16,
bfloat16, 256 query tokens, 64 sequences) over a grid of tunings, and prints per tuning: the
registers per thread and spilled bytes (ptxas -v on the kernel's PTX), its dynamic shared
memory (XLA's thunk sequence), the compile time, and whether the kernel's own guard accepts
it. A tuning "compiles" when ptxas builds it without spills and within the shared memory
limit; the guard (gpu.check_tuning) only knows what can never launch, so a tuning it accepts
may still fail here: the table is the record of which do. Needs `pip install -e '.[preflight]'`.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

import kernels_pallas  # noqa: E402, F401  (registers the backends)
from jaxserve.worker.targets import make_devices, parse_target  # noqa: E402
from kernels_pallas.ragged_paged_attention import gpu  # noqa: E402
from kernels_pallas.registry import AttentionSpec  # noqa: E402

# Llama-3-8B attention, one 256-token step of 64 sequences over 4,096 pages.
Q_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, TOKENS, SEQS, PAGES, PAGES_PER_SEQ = 32, 8, 128, 16, 256, 64, 4096, 512


@dataclass
class Row:
    target: str
    block_q: int
    pages_per_block: int
    num_warps: int
    num_stages: int
    guard: str  # "ok" or the guard's reason
    compiled: bool
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    compile_s: float = 0.0
    error: str = ""


def ptxas() -> str:
    import nvidia.cuda_nvcc  # the preflight extra's ptxas (a namespace package)

    return os.path.join(list(nvidia.cuda_nvcc.__path__)[0], "bin", "ptxas")


def _ptxas_report(dump: str) -> tuple[int | None, int | None]:
    """(registers, spilled bytes) of the attention kernel's PTX in an XLA dump."""
    for path in glob.glob(f"{dump}/*.ptx"):
        text = open(path).read()
        if "ragged_paged_attention_gpu" not in text:
            continue
        arch = re.search(r"\.target\s+(sm_\w+)", text).group(1)
        out = subprocess.run([ptxas(), "-v", f"-arch={arch}", path, "-o", os.devnull],
                             capture_output=True, text=True).stderr
        regs = re.search(r"Used (\d+) registers", out)
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", out)]
        return (int(regs.group(1)) if regs else None), max(spills, default=0)
    return None, None


def _shared_bytes(dump: str) -> int | None:
    for path in glob.glob(f"{dump}/*thunk_sequence.txt"):
        m = re.search(r"ragged_paged_attention_gpu grid: .* shared_memory: (\d+) bytes", open(path).read())
        if m:
            return int(m.group(1))
    return None


def check(target: str, device, block_q: int, pages_per_block: int, num_warps: int,
          num_stages: int) -> Row:
    tuning = dict(block_q=block_q, pages_per_block=pages_per_block, num_warps=num_warps,
                  num_stages=num_stages)
    row = Row(target, block_q, pages_per_block, num_warps, num_stages, "ok", False)
    try:
        gpu.check_tuning(**tuning)
    except ValueError as e:
        row.guard = str(e)
    on = SingleDeviceSharding(device)
    a = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on)  # noqa: E731
    args = (a((TOKENS, Q_HEADS, HEAD_DIM), jnp.bfloat16),
            a((PAGES, PAGE_SIZE, 2 * KV_HEADS, HEAD_DIM), jnp.bfloat16), a((SEQS,), jnp.int32),
            a((SEQS, PAGES_PER_SEQ), jnp.int32), a((SEQS + 1,), jnp.int32), a((1,), jnp.int32))
    # The kernel itself, past the guard: what would the compiler say?
    spec = AttentionSpec(sm_scale=HEAD_DIM ** -0.5)
    fn = lambda *x: gpu.ragged_paged_attention(  # noqa: E731
        *x, spec=spec, tuning=gpu.GpuTuning(**tuning, check=False))
    dump = tempfile.mkdtemp(prefix="gpu_tuning_")
    t0 = time.perf_counter()
    try:
        jax.jit(fn).trace(*args).lower().compile({"xla_dump_to": dump})
        row.compiled = True
    except Exception as e:  # noqa: BLE001 - the compiler's verdict is the result
        row.error = " ".join(str(e).split())[:160]
    row.compile_s = time.perf_counter() - t0
    row.registers, row.spill_bytes = _ptxas_report(dump)
    row.shared_bytes = _shared_bytes(dump)
    if row.compiled and row.spill_bytes:
        row.compiled, row.error = False, f"{row.spill_bytes} B of register spills"
    return row


GRID = dict(block_q=(1, 2, 4, 8, 16, 32), pages_per_block=(1, 2, 4, 8, 16),
            num_warps=(4, 8), num_stages=(2,))
QUICK = [  # (block_q, pages_per_block, num_warps, num_stages): default, edges, failures
    (8, 4, 4, 2), (2, 1, 4, 2), (1, 1, 4, 2), (32, 8, 4, 2), (16, 16, 8, 2), (64, 16, 4, 2),
    (8, 4, 64, 2), (8, 4, 8, 3),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default="h100,h200")
    p.add_argument("--quick", action="store_true", help="a handful of tunings, not the grid")
    args = p.parse_args(argv)
    combos = QUICK if args.quick else list(itertools.product(*GRID.values()))
    rows = []
    print("| target | block_q x group | keys | warps | stages | guard | compiles | registers "
          "| spills (B) | shared (B) | compile (s) | compiler |")
    print("|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---|")
    for name in args.targets.split(","):
        device = make_devices(parse_target(name), 1)[0]
        for bq, ppb, warps, stages in combos:
            r = check(name, device, bq, ppb, warps, stages)
            rows.append(r)
            group_pad = gpu.next_pow2(Q_HEADS // KV_HEADS)
            print(f"| {name} | {bq} x {group_pad} = {bq * group_pad} | {ppb * PAGE_SIZE} | "
                  f"{warps} | {stages} | {'accepts' if r.guard == 'ok' else 'rejects'} | "
                  f"{'yes' if r.compiled else 'no'} | {r.registers} | {r.spill_bytes} | "
                  f"{r.shared_bytes} | {r.compile_s:.1f} | {r.error or 'ok'} |", flush=True)
    # The guard may accept what the compiler refuses (shared memory, spills), never the reverse.
    wrong = [r for r in rows if r.compiled and r.guard != "ok"]
    for r in wrong:
        print(f"the guard rejects a tuning that compiles: {r}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
