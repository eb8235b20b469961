"""The mixture-of-experts layer (jaxserve/models/moe.py) on this machine against the dense
SwiGLU that does the same work (intermediate size top_k x moe_intermediate_size: the FLOPs
of the routed experts), over token counts and expert shapes; float32, jitted, median of runs.
Both grouped matmuls: the blocked one the CPU runs, and XLA's ragged_dot (accelerators').

    python scripts/bench_moe.py [--hidden 512] [--moe-intermediate 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.moe import experts_ffn, route


def timed(fn, *args, runs: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--moe-intermediate", type=int, default=256)
    args = p.parse_args()
    H, I = args.hidden, args.moe_intermediate
    rng = np.random.default_rng(0)
    print(f"{jax.devices()[0].device_kind}; H={H}, moe_intermediate={I}, float32")
    print(f"{'tokens':>6} {'experts':>7} {'top_k':>5} {'blocked ms':>10} {'ragged_dot ms':>13} "
          f"{'dense ms':>8} {'blocked/dense':>13} {'blocked GFLOP/s':>15}")
    for E, k in ((8, 2), (64, 8), (128, 8)):
        w = [jnp.asarray(rng.normal(0, 0.02, s), jnp.float32)
             for s in ((H, E), (E, H, I), (E, H, I), (E, I, H))]
        dense = [jnp.asarray(rng.normal(0, 0.02, s), jnp.float32)
                 for s in ((H, k * I), (H, k * I), (k * I, H))]

        def moe(platform):
            @jax.jit
            def run(x, router, wg, wu, wd):
                weights, experts = route(x @ router, k, True)
                return experts_ffn(x, weights, experts, wg, wu, wd, 0, platform)
            return run

        blocked, ragged = moe("cpu"), moe("xla")

        @jax.jit
        def swiglu(x, wg, wu, wd):
            return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd

        for T in (1, 16, 64, 512):
            x = jnp.asarray(rng.normal(size=(T, H)), jnp.float32)
            t_moe, t_dense = timed(blocked, x, *w), timed(swiglu, x, *dense)
            t_ragged = timed(ragged, x, *w, runs=3)
            np.testing.assert_allclose(blocked(x, *w), ragged(x, *w), rtol=1e-4, atol=1e-6)
            flops = 2 * T * k * 3 * H * I + 2 * T * H * E
            print(f"{T:>6} {E:>7} {k:>5} {t_moe * 1e3:>10.3f} {t_ragged * 1e3:>13.3f} "
                  f"{t_dense * 1e3:>8.3f} {t_moe / t_dense:>13.2f} {flops / t_moe / 1e9:>15.1f}")


if __name__ == "__main__":
    main()
