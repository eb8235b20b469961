"""The Gated DeltaNet delta rule's two ragged forms (kernels_pallas/gated_delta_rule/reference.py),
jitted alone on one layer of docs/benchmarks.md's ~230M hybrid (12 value heads, 6 key heads,
dk = dv = 64; steps of 512 tokens over 16 rows): mean milliseconds of 5 runs each.

    python scripts/bench_gated_delta_rule.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.gated_delta_rule import reference as gdn

T, ROWS, HK, HV, D = 512, 16, 6, 12, 64


def main() -> None:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((T, HK, D)), jnp.float32)
    k = q * 0.5
    v = jnp.asarray(rng.standard_normal((T, HV, D)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0, 1, (T, HV)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (T, HV)), jnp.float32)
    states = jnp.zeros((2 * ROWS + 1, HV, D, D), jnp.float32)
    slots = jnp.arange(1, ROWS + 1, dtype=jnp.int32)
    for name, lens in (("2 prompts x 256", [256, 256]), ("16 prompts x 32", [32] * 16),
                       ("16 decodes", [1] * 16)):
        n = sum(lens)
        cu = np.full(ROWS + 1, n, np.int32)
        cu[0], cu[1:len(lens) + 1] = 0, np.cumsum(lens)
        args = (q[:n], k[:n], v[:n], g[:n], beta[:n], states, slots, jnp.asarray(cu),
                jnp.int32(len(lens)), jnp.zeros(ROWS, bool))
        for form, fn in (("token", gdn.ragged_gated_delta_rule),
                         ("chunked", gdn.ragged_gated_delta_rule_chunked)):
            run = jax.jit(fn)
            jax.block_until_ready(run(*args))
            t = time.perf_counter()
            for _ in range(5):
                jax.block_until_ready(run(*args))
            print(f"{name:>16}  {form:>7}  {(time.perf_counter() - t) / 5 * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
