"""The int8 matmul at decode shapes: the CPU kernel against XLA's (dequantize + dot, as
jaxserve runs it without the kernel: the LM head in row chunks).

A stack of layers shaped like the default model (hidden 576, intermediate 1536, 3 of 9
heads for K/V, 30 layers) run under a layer scan as the model runs them, then the tied
49152-row LM head, at 1 to 32 tokens; random int8 weights (132M, as the default model).

    PYTHONPATH=. python scripts/bench_int8_matmul.py [--tokens 1 2 4 8 16 32]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.quantization import int8_matmul_rows
from kernels_pallas.int8_matmul import cpu, int8_matmul

L, H, I, KV, VOCAB, G = 30, 576, 1536, 192, 49152, 64
SHAPES = {"q": (H, H), "k": (KV, H), "v": (KV, H), "o": (H, H), "gate": (I, H), "up": (I, H), "down": (H, I)}


def weights(rng: np.random.Generator) -> tuple[dict, tuple]:
    def q(*shape: int) -> tuple[jax.Array, jax.Array]:
        return (jnp.asarray(rng.integers(-127, 128, shape, dtype=np.int8)),
                jnp.asarray(rng.uniform(1e-4, 2e-4, (*shape[:-1], shape[-1] // G)).astype(np.float32)))
    return {n: q(L, o, i) for n, (o, i) in SHAPES.items()}, q(VOCAB, H)


def model(x: jax.Array, layers: dict, head: tuple, backend: str) -> jax.Array:
    def mm(h: jax.Array, w: tuple, i: jax.Array | None = None) -> jax.Array:
        if backend == "xla":
            return int8_matmul_rows(h, *w, i, cpu_kernel=False)
        return int8_matmul(h, *w, i, backend=backend)

    def layer(h: jax.Array, i: jax.Array) -> tuple[jax.Array, None]:
        p = layers
        a = mm(h, p["q"], i) + jnp.pad(mm(h, p["k"], i) + mm(h, p["v"], i), ((0, 0), (0, H - KV)))
        h = h + mm(a, p["o"], i)
        h = h + mm(jax.nn.silu(mm(h, p["gate"], i)) * mm(h, p["up"], i), p["down"], i)
        return h / jnp.linalg.norm(h, axis=-1, keepdims=True), None

    h, _ = jax.lax.scan(layer, x, jnp.arange(L, dtype=jnp.int32))
    return mm(h, head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if not cpu.available():
        raise SystemExit(f"the CPU kernel is unavailable: {cpu.unavailable_reason()}")
    rng = np.random.default_rng(0)
    layers, head = weights(rng)
    print(f"{L} layers + LM head, {sum(q.size for q, _ in [*layers.values(), head]) / 1e6:.0f}M int8 weights, "
          f"{jax.device_count()} CPU device, median of {args.repeats}")
    print("| tokens | XLA (ms) | kernel (ms) | speed-up | max rel. diff |")
    print("|---:|---:|---:|---:|---:|")
    for m in args.tokens:
        x = jnp.asarray(rng.standard_normal((m, H)).astype(np.float32))
        times, outs = {}, {}
        for backend in ("xla", "cpu"):
            f = jax.jit(lambda x, b=backend: model(x, layers, head, b))
            outs[backend] = f(x).block_until_ready()
            ts = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                f(x).block_until_ready()
                ts.append(time.perf_counter() - t)
            times[backend] = float(np.median(ts)) * 1e3
        ref = outs["xla"]
        diff = float(jnp.max(jnp.abs(outs["cpu"] - ref)) / jnp.max(jnp.abs(ref)))
        print(f"| {m} | {times['xla']:.2f} | {times['cpu']:.2f} | "
              f"{times['xla'] / times['cpu']:.2f}x | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
