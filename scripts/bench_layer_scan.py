"""What the layer scan's weight slices cost on the CPU: a 30-layer scan of float32
[576, 1536] / [1536, 576] matmuls (the default model's MLP shapes) against the same layers
unrolled, at 1, 16 and 64 rows. Figures in docs/benchmarks.md.

    python scripts/bench_layer_scan.py
"""

from __future__ import annotations

import time


def main() -> None:
    """Print the scanned and unrolled times and the scan's FLOP rate per row count."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    L, H, I = 30, 576, 1536
    rng = np.random.default_rng(0)
    w1 = jnp.asarray(rng.normal(size=(L, H, I)).astype(np.float32) * 0.03)
    w2 = jnp.asarray(rng.normal(size=(L, I, H)).astype(np.float32) * 0.03)

    def body(h, w):
        return h + jnp.tanh(h @ w[0]) @ w[1], None

    scanned = jax.jit(lambda h, a, b: jax.lax.scan(body, h, (a, b))[0])

    def unrolled(h, a, b):
        for i in range(L):
            h, _ = body(h, (a[i], b[i]))
        return h

    def bench(f, *args, n: int = 20) -> float:
        jax.block_until_ready(f(*args))
        t0 = time.perf_counter()
        for _ in range(n):
            jax.block_until_ready(f(*args))
        return (time.perf_counter() - t0) / n * 1e3

    for R in (1, 16, 64):
        h = jnp.asarray(rng.normal(size=(R, H)).astype(np.float32))
        ts, tu = bench(scanned, h, w1, w2), bench(jax.jit(unrolled), h, w1, w2)
        gflops = 4 * R * H * I * L / ts / 1e6
        print(f"rows {R:3d}: scan {ts:7.2f} ms ({gflops:.0f} GFLOP/s), unrolled {tu:7.2f} ms")


if __name__ == "__main__":
    main()
