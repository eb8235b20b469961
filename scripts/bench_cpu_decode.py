"""The CPU decode attention alone over a bf16 cache: the C++ kernel's bf16 dots (AVX512-BF16,
vdpbf16ps) against its float32 dots (AVX2/FMA), in one process.

    python scripts/bench_cpu_decode.py [--batches 1x2000,16x1024,64x300] [--rounds 5]

One layer's decode step for ROWSxCONTEXT (that many sequences, one query token each, at that
many tokens of context), the default model's heads (9 query, 3 KV heads of 64), 16-token pages
scattered over the cache, the cache as the CPU keeps bf16 (its bits in uint16). The two dot
types alternate; each figure is the best of `--rounds` rounds, with the KV bytes the step
reads per second and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.ragged_paged_attention import _decode_cpu

QH, KVH, D, PAGE = 9, 3, 64, 16


def batch(rows: int, context: int) -> tuple:
    pages = -(-context // PAGE)
    rng = np.random.default_rng(0)
    num_pages = rows * pages + 1
    kv = jnp.asarray(rng.standard_normal((num_pages, PAGE, 2 * KVH, D)), jnp.bfloat16)
    table = rng.permutation(num_pages)[: rows * pages].reshape(rows, pages).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((rows, QH, D)), jnp.float32)
    return (q, jax.lax.bitcast_convert_type(kv, jnp.uint16), jnp.asarray(table),
            jnp.arange(rows, dtype=jnp.int32), jnp.full((rows,), context - 1, jnp.int32),
            jnp.asarray([rows], jnp.int32))


def seconds(fn, args, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1x2000,16x1024,64x300", help="ROWSxCONTEXT, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dots = ["float32"] + (["bfloat16"] if _decode_cpu.bf16_dots(jnp.uint16, D, PAGE) else [])
    print(f"bf16 dots on this CPU: {'bfloat16' in dots} ({_decode_cpu.unavailable_reason() or 'kernel built'})")
    print("rows  context  " + "  ".join(f"{d:>9} us  KV GB/s" for d in dots) + "  speed-up  max |diff|")
    for spec in args.batches.split(","):
        rows, context = (int(x) for x in spec.split("x"))
        operands = batch(rows, context)
        fns = [jax.jit(functools.partial(_decode_cpu.paged_decode_attention, sm_scale=0.125,
                                         soft_cap=None, sliding_window=None, dots=d)) for d in dots]
        outs = [np.asarray(fn(*operands)) for fn in fns]
        calls = max(10, 40_000 // max(rows * context // PAGE, 1))
        best = [float("inf")] * len(fns)
        for _ in range(args.rounds):
            for i, fn in enumerate(fns):
                best[i] = min(best[i], seconds(fn, operands, calls))
        kv_bytes = rows * context * 2 * KVH * D * 2
        cells = "  ".join(f"{b * 1e6:12.1f}  {kv_bytes / b / 1e9:7.1f}" for b in best)
        speedup = f"{best[0] / best[-1]:8.2f}x" if len(best) > 1 else "       -"
        diff = np.abs(outs[-1] - outs[0]).max()
        print(f"{rows:4d}  {context:7d}  {cells}  {speedup}  {diff:.1e}")


if __name__ == "__main__":
    main()
