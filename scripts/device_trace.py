"""Where a decode step's time goes on a lent GPU/TPU (after scripts/device_check.py showed the
step far from its roofline): a profiler trace of the engine's decode steps on random
Llama-3-8B-shaped weights, and the layer scan alone at those shapes (scanned and unrolled).

    python scripts/device_trace.py          # on the device; $OUT/trace0.xplane.pb comes back
    python scripts/device_trace.py --read FILE   # here: each program on the GPU's timeline,
                                                 # the gaps, a forward's busy kernels (xprof)
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import device_check as dc  # scripts/device_check.py
import jax
import jax.numpy as jnp
import numpy as np


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


def read(xplane: str) -> None:
    """The GPU timeline of a trace: each XLA program's time and the idle gap before it, then
    the kernels that ran during the second-last forward (`pip install xprof` to read)."""
    import collections
    import json

    from xprof.convert import raw_to_tool_data

    data, _ = raw_to_tool_data.xspace_to_tool_data([xplane], "trace_viewer", {})
    events = json.loads(data)["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = next(e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and "GPU" in e["args"]["name"])
    line = lambda word: next(t for (p, t), n in names.items() if p == gpu and word in n)  # noqa: E731
    spans = lambda tid: sorted((e for e in events if e.get("ph") == "X" and e["pid"] == gpu  # noqa: E731
                                and e.get("tid") == tid), key=lambda e: e["ts"])
    modules, end = spans(line("XLA Modules")), None
    for e in modules:
        gap = f"{(e['ts'] - end) / 1e3:8.3f}" if end is not None else "       -"
        print(f"{e['dur'] / 1e3:8.3f} ms after a gap of {gap} ms  {e['name']}")
        end = e["ts"] + e["dur"]
    forward = [e for e in modules if e["name"].startswith("jit_stage_fn")][-2]
    kernels: collections.Counter[str] = collections.Counter()
    for e in spans(line("Compute")):
        if forward["ts"] <= e["ts"] <= forward["ts"] + forward["dur"]:
            kernels[e["name"][:70]] += e.get("dur", 0)
    print(f"one forward: {forward['dur'] / 1e3:.3f} ms, kernels busy "
          f"{sum(kernels.values()) / 1e3:.3f} ms")
    for name, us in kernels.most_common(12):
        print(f"  {us / 1e3:7.3f} ms  {name}")


def main() -> None:
    if "--read" in sys.argv:
        return read(sys.argv[sys.argv.index("--read") + 1])
    from jaxserve import LLM

    smoke = "--smoke" in sys.argv  # tiny shapes, to test the script off-device
    arch = dc.TINY if smoke else dc.LLAMA3_8B
    shape = (arch["num_hidden_layers"], arch["hidden_size"], arch["intermediate_size"])
    out = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    weight_bytes = 3 * np.prod(shape) * 2
    # XLA's other way out of the loop's weight copy: cuBLAS GEMMs reading the slice in place
    # (jax 0.10.2 fails to compile the engine's forward with it; docs/benchmarks.md).
    cublas = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_dynamic_slice_fusion": True}
    variants = [("scan", True, None), ("unrolled", False, None)]
    if jax.devices()[0].platform == "gpu":
        variants += [("scan, cuBLAS in slice fusions", True, cublas),
                     ("unrolled, same options", False, cublas)]
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
