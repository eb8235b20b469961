"""The CPU prefill attention alone: the C++ kernel (prefill_cpu.cc) against the XLA loop.

    python scripts/bench_cpu_prefill.py [--context 512,1800] [--chunk 512] [--calls 10]

One layer's attention for a prompt chunk of `--chunk` tokens ending at each `--context`, the
default model's heads (9 query, 3 KV heads of 64), 16-token pages; float32, bfloat16 and
bfloat16-bits (the CPU's bf16 layout) caches. The two paths alternate and each figure is the
best of two rounds of `--calls` calls; the largest difference from the XLA loop's output is
printed beside it (bf16 dots round q and the softmax weights to bf16).
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import AttentionSpec
from kernels_pallas.ragged_paged_attention import _prefill_cpu, cpu

QH, KVH, D, PAGE = 9, 3, 64, 16


def batch(chunk: int, context: int, dtype) -> tuple:
    pages = -(-context // PAGE)
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((pages + 1, PAGE, 2 * KVH, D)), dtype)
    q = jnp.asarray(rng.standard_normal((chunk, QH, D)), jnp.float32)
    table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]
    return (q, kv, jnp.asarray([context], jnp.int32), table, jnp.asarray([0, chunk], jnp.int32),
            jnp.asarray([1], jnp.int32))


def best_ms(fn, args, calls: int) -> float:
    fn(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", default="512,1800", help="context lengths, comma-separated")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args()
    if not _prefill_cpu.available():
        raise SystemExit(f"the prefill kernel does not run here: {_prefill_cpu.unavailable_reason()}")
    print(f"bf16 dots over a bf16 cache: {_prefill_cpu.bf16_dots(jnp.bfloat16)}")
    print("cache     context  XLA loop ms  kernel ms  speed-up  max |diff|")
    for name, dtype, kv_dtype in (("float32", jnp.float32, "auto"), ("bfloat16", jnp.bfloat16, "auto"),
                                  ("bf16 bits", jnp.bfloat16, "bfloat16")):
        for context in map(int, args.context.split(",")):
            b = batch(min(args.chunk, context), context, dtype)
            if kv_dtype != "auto":
                b = (b[0], jax.lax.bitcast_convert_type(b[1], jnp.uint16), *b[2:])
            spec = AttentionSpec(sm_scale=D ** -0.5, kv_cache_dtype=kv_dtype)
            fns = {k: jax.jit(functools.partial(cpu.ragged_paged_attention, spec=spec,
                                                tuning=cpu.CpuTuning(prefill_kernel=k)))
                   for k in ("xla", "auto")}
            times: dict[str, list[float]] = {"xla": [], "auto": []}
            for _ in range(2):
                for k, fn in fns.items():
                    times[k].append(best_ms(fn, b, args.calls))
            diff = float(jnp.abs(fns["xla"](*b) - fns["auto"](*b)).max())
            x, c = min(times["xla"]), min(times["auto"])
            print(f"{name:9} {context:7d}  {x:11.2f}  {c:9.2f}  {x / c:7.2f}x  {diff:.1e}")


if __name__ == "__main__":
    main()
