"""The matmul paths for the layer scan on the CPU, side by side: a 30-layer scan of the
default model's seven projections (SmolLM2-135M shapes) at 1-512 rows, five ways:

- XLA float32 (the float path: the scan slices and copies each layer's weights);
- the int8 kernel (`--quantization int8`: whole stack, layer index);
- bf16 weights, `kernels_pallas.bf16_matmul`'s few-token kernel (`backend="cpu"`);
- bf16 weights through oneDNN (`backend="onednn"`; skipped where it is unavailable);
- bf16 weights packed once for oneDNN (`bf16_matmul_packed`, what the CPU's default runs
  where oneDNN is native: our AVX512-BF16 kernel up to PACKED_FEW_TOKENS rows, oneDNN
  beyond; skipped with oneDNN), and the same weights through oneDNN alone ("packed onednn").

Each path's 30-layer drift from float32 is printed beside its time; `auto` picks between
the two plain bf16 paths at `CPU_KERNEL_MAX_TOKENS`, which these figures are for choosing.

    python scripts/bench_bf16_matmul.py [--rows 1 4 8 16 32 64 256 512] [--packed-few-tokens N]
"""

from __future__ import annotations

import argparse
import time

L, H, I, KV = 30, 576, 1536, 192  # layers, hidden, intermediate, k/v width of SmolLM2-135M


def main() -> None:
    """Print each path's time for the 30-layer scan per row count."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 256, 512])
    parser.add_argument("--packed-few-tokens", type=int, default=None,
                        help="also time packed weights with the few-token kernel up to this many rows")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import kernels_pallas.bf16_matmul as bf16_kernel
    import kernels_pallas.int8_matmul as int8_kernel
    from jaxserve.models.quantization import quantize_int8
    from kernels_pallas.bf16_matmul import cpu as bf16_cpu

    rng = np.random.default_rng(0)
    shapes = dict(q=(H, H), k=(H, KV), v=(H, KV), o=(H, H), g=(H, I), u=(H, I), d=(I, H))  # [in, out]
    w32 = {n: rng.standard_normal((L, *s), np.float32) / np.sqrt(s[0]) for n, s in shapes.items()}
    w_nk = {n: np.ascontiguousarray(np.swapaxes(w, 1, 2)) for n, w in w32.items()}  # [L, out, in]
    bf16 = {n: jnp.asarray(w, jnp.bfloat16) for n, w in w_nk.items()}
    stacks = {
        "xla f32": {n: jnp.asarray(w) for n, w in w32.items()},
        "int8 kernel": {n: tuple(map(jnp.asarray, quantize_int8(w, in_axis=-1))) for n, w in w_nk.items()},
        "bf16 kernel": bf16,
        "bf16 onednn": bf16,
    }
    if bf16_cpu.onednn_available():
        stacks["bf16 packed"] = {n: jnp.asarray(bf16_kernel.pack_weights(np.asarray(w))) for n, w in bf16.items()}
    matmul = {
        "xla f32": None,  # the scan slices: x @ w
        "int8 kernel": lambda x, qs, l: int8_kernel.int8_matmul(x, *qs, l, backend="cpu"),
        "bf16 kernel": lambda x, w, l: bf16_kernel.bf16_matmul(x, w, l, backend="cpu"),
        "bf16 onednn": lambda x, w, l: bf16_kernel.bf16_matmul(x, w, l, backend="onednn"),
        "bf16 packed": None,  # needs each projection's width: `model` passes it
    }
    if not bf16_cpu.onednn_available():
        print(f"oneDNN unavailable ({bf16_cpu.onednn_unavailable_reason()}): its columns are skipped")
        del stacks["bf16 onednn"], matmul["bf16 onednn"], matmul["bf16 packed"]

    def layer(mm, h: jax.Array) -> jax.Array:
        q, k, v = mm("q", h), mm("k", h), mm("v", h)
        h = h + mm("o", q + jnp.tile(k + v, (1, 3)))
        x = h / jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)  # keep 30 layers finite
        return h + mm("d", jax.nn.silu(mm("g", x)) * mm("u", x))

    def model(name: str, few: int = bf16_kernel.PACKED_FEW_TOKENS):
        if name == "bf16 packed":
            return jax.jit(lambda x, W: jax.lax.scan(
                lambda h, l: (layer(lambda n, a: bf16_kernel.bf16_matmul_packed(a, W[n], shapes[n][1], l, few), h),
                              None), x, jnp.arange(L, dtype=jnp.int32))[0])
        if matmul[name] is None:
            return jax.jit(lambda x, W: jax.lax.scan(
                lambda h, w: (layer(lambda n, a: a @ w[n], h), None), x, W)[0])
        fn = matmul[name]
        return jax.jit(lambda x, W: jax.lax.scan(
            lambda h, l: (layer(lambda n, a: fn(a, W[n], l), h), None), x, jnp.arange(L, dtype=jnp.int32))[0])

    def bench(f, *a, reps: int = 10) -> float:
        f(*a).block_until_ready()
        t = time.perf_counter()
        for _ in range(reps):
            r = f(*a)
        r.block_until_ready()
        return (time.perf_counter() - t) / reps * 1e3

    fns = {name: model(name) for name in stacks}
    if "bf16 packed" in stacks:  # oneDNN alone on the packed weights, beside the default split
        stacks["packed onednn"] = stacks["bf16 packed"]
        fns["packed onednn"] = model("bf16 packed", few=0)
        if args.packed_few_tokens is not None:  # another split, to choose PACKED_FEW_TOKENS
            stacks["packed split"] = stacks["bf16 packed"]
            fns["packed split"] = model("bf16 packed", few=args.packed_few_tokens)
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, H), np.float32))
        ms = {name: bench(fns[name], x, stacks[name]) for name in stacks}
        ref = np.asarray(fns["xla f32"](x, stacks["xla f32"]))
        drift = {n: float(np.max(np.abs(np.asarray(fns[n](x, stacks[n])) - ref)) / np.max(np.abs(ref)))
                 for n in stacks if n != "xla f32"}
        print(f"{rows:4d} rows: " + "  ".join(f"{n} {t:7.2f} ms" for n, t in ms.items())
              + "  | 30-layer drift vs f32: " + ", ".join(f"{n} {d:.1e}" for n, d in drift.items()),
              flush=True)


if __name__ == "__main__":
    main()
