"""Where a decode step's time goes on a lent GPU/TPU (after scripts/device_check.py showed the
step far from its roofline): a profiler trace of the engine's decode steps on random
Llama-3-8B-shaped weights, and the layer scan alone at those shapes (scanned and unrolled).

    python scripts/device_trace.py          # on the device; $OUT/trace.xplane.pb comes back
    python scripts/profile_step.py --xplane FILE   # here: read the trace (xprof)
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import device_check as dc  # scripts/device_check.py


def layer_scan(rows: int, scanned: bool, L: int, H: int, I: int,
               options: dict | None = None) -> float:
    """Seconds for the MLP matmuls of L layers (bf16), scanned or unrolled, compiled with
    XLA `options`."""
    key = jax.random.key(0)
    up = jax.random.normal(key, (L, H, 2 * I), jnp.bfloat16)
    down = jax.random.normal(key, (L, I, H), jnp.bfloat16)
    h = jax.random.normal(key, (rows, H), jnp.bfloat16)

    def body(x, w):
        g, u = jnp.split(x @ w[0], 2, axis=-1)
        return x + (jax.nn.silu(g) * u) @ w[1], None

    if scanned:
        f = jax.jit(lambda x, a, b: jax.lax.scan(body, x, (a, b))[0], compiler_options=options)
    else:
        def unrolled(x, a, b):
            for i in range(L):
                x, _ = body(x, (a[i], b[i]))
            return x
        f = jax.jit(unrolled, compiler_options=options)
    jax.block_until_ready(f(h, up, down))
    t = time.perf_counter()
    for _ in range(10):
        out = f(h, up, down)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / 10


def main() -> None:
    from jaxserve import LLM

    smoke = "--smoke" in sys.argv  # tiny shapes, to test the script off-device
    arch = dc.TINY if smoke else dc.LLAMA3_8B
    shape = (arch["num_hidden_layers"], arch["hidden_size"], arch["intermediate_size"])
    out = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    weight_bytes = 3 * np.prod(shape) * 2
    from jaxserve.parallel.sharding import STAGE_COMPILER_OPTIONS

    variants = [("scan", True, None), ("unrolled", False, None)]
    platform = jax.devices()[0].platform
    if platform in STAGE_COMPILER_OPTIONS:
        opts = STAGE_COMPILER_OPTIONS[platform]
        variants += [("scan, the forward's options", True, opts),
                     ("unrolled, the forward's options", False, opts)]
    for rows in () if "--trace-only" in sys.argv else (1, 16, 64):
        for name, scanned, opts in variants:
            s = layer_scan(rows, scanned, *shape, options=opts)
            print(f"MLP layers alone, {name:32s} rows {rows:3d}: "
                  f"{1e3 * s:7.3f} ms, {weight_bytes / s / 1e9:7.1f} GB/s", flush=True)
    if "--scan-only" in sys.argv:
        return
    path = Path(tempfile.mkdtemp(prefix="dummy_model_"))
    dc.write_dummy_model(path, arch)
    llm = LLM(str(path), load_format="dummy", max_model_len=1024 if smoke else 2048, max_num_seqs=64,
              max_num_batched_tokens=2048, enforce_eager=True)
    vocab, context = arch["vocab_size"], 64 if smoke else 1024
    for batch in (1, 16):
        print(f"decode batch {batch} at {context}: {1e3 * dc.decode_step_s(llm, batch, context, vocab):.3f} ms"
              " a step (untraced)", flush=True)
    trace_dir = tempfile.mkdtemp(prefix="trace_")
    jax.profiler.start_trace(trace_dir)
    s = dc.decode_step_s(llm, 16, context, vocab, window=8)
    jax.profiler.stop_trace()
    print(f"decode batch 16 at {context}, traced: {1e3 * s:.3f} ms a step")
    for i, f in enumerate(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)):
        shutil.copy(f, out / f"trace{i}.xplane.pb")
        print("trace:", f, os.path.getsize(f))
    llm.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
