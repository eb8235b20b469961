"""Time the on-device sampler alone over a vocabulary, as the model runner calls it (every
output returned): greedy and random rows, no logprobs asked, no penalties.

    python scripts/bench_sampler.py [--vocab 49152] [--rows 1 16 64]

Run it under another checkout (`PYTHONPATH=...`) for a before/after; figures in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    """Print the sampler's time per call for each row count and mode."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)  # the default model's
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--iters", type=int, default=40)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.worker.sampler import SamplerMode, SamplingMetadata, sample

    for mode, temperature in ((SamplerMode.GREEDY, 0.0), (SamplerMode.RANDOM, 0.8)):
        for R in args.rows:
            def full(dtype, value=0):
                return jnp.full((R,), value, dtype)

            fields = dict(temperature=full(jnp.float32, temperature), top_k=full(jnp.int32),
                          top_p=full(jnp.float32, 1.0), min_p=full(jnp.float32),
                          repetition_penalty=full(jnp.float32, 1.0),
                          frequency_penalty=full(jnp.float32), presence_penalty=full(jnp.float32),
                          seeds=full(jnp.uint32), positions=full(jnp.int32),
                          min_tokens_end=full(jnp.int32))
            if "logprobs" in SamplingMetadata.__dataclass_fields__:  # older checkouts lack it
                fields["logprobs"] = jnp.zeros((R,), bool)
            md = SamplingMetadata(**fields)
            logits = jnp.asarray(np.random.default_rng(0).normal(size=(R, args.vocab)), jnp.float32)
            prompt_mask = jnp.zeros((R, args.vocab), bool)
            counts = jnp.zeros((R, args.vocab), jnp.int32)
            run = jax.jit(lambda x, p, c, md: sample(x, p, c, md, mode))
            jax.block_until_ready(run(logits, prompt_mask, counts, md))
            t0 = time.perf_counter()
            for _ in range(args.iters):
                jax.block_until_ready(run(logits, prompt_mask, counts, md))
            ms = (time.perf_counter() - t0) / args.iters * 1e3
            print(f"{mode.value:7s} rows {R:4d}: {ms:7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
