"""Experiment for issue 25: is oneDNN's bf16 matmul, reading each layer in place from the
stacked weights, the lever for the layer scan on the CPU? A 30-layer scan of the default
model's seven projections (SmolLM2-135M shapes) at 1-512 rows, three ways:

- XLA float32 (today's default path: the scan slices and copies each layer's weights);
- the int8 kernel (`--quantization int8`: whole stack, layer index; its kernel up to 32 rows);
- `scripts/onednn_bf16_matmul.cc` (bf16 weights, activations cast at the call, float32 out).

The oneDNN product is first checked against a float32 dot of the bf16-rounded operands (the
int8 kernel has its own tests), and each path's 30-layer drift from float32 is printed. Needs Debian's oneDNN (`apt-get install libdnnl-dev`) and g++.

    python scripts/bench_onednn_bf16.py [--rows 1 4 16 64 256 512]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

SOURCE = Path(__file__).with_name("onednn_bf16_matmul.cc")
L, H, I, KV = 30, 576, 1536, 192  # layers, hidden, intermediate, k/v width of SmolLM2-135M


def build() -> Path:
    """Compile the FFI handler against jaxlib's headers and the system's oneDNN."""
    import jax.ffi

    out = Path(tempfile.mkdtemp()) / "libonednn_bf16_matmul.so"
    subprocess.run(["g++", "-O3", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
                    str(SOURCE), "-ldnnl", "-o", str(out)], check=True)
    return out


def main() -> None:
    """Print each path's time for the 30-layer scan per row count."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 512])
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import kernels_pallas.int8_matmul as int8_kernel
    from jaxserve.models.quantization import quantize_int8

    lib = ctypes.cdll.LoadLibrary(str(build()))
    jax.ffi.register_ffi_target("onednn_bf16_matmul", jax.ffi.pycapsule(lib.OnednnBf16Matmul), platform="cpu")

    def bf16_mm(x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array:
        out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
        return jax.ffi.ffi_call("onednn_bf16_matmul", out)(x.astype(jnp.bfloat16), w, layer)

    rng = np.random.default_rng(0)
    shapes = dict(q=(H, H), k=(H, KV), v=(H, KV), o=(H, H), g=(H, I), u=(H, I), d=(I, H))  # [in, out]
    w32 = {n: rng.standard_normal((L, *s), np.float32) / np.sqrt(s[0]) for n, s in shapes.items()}
    w_nk = {n: np.ascontiguousarray(np.swapaxes(w, 1, 2)) for n, w in w32.items()}  # [L, out, in]
    stacks = {
        "xla f32": {n: jnp.asarray(w) for n, w in w32.items()},
        "int8 kernel": {n: tuple(map(jnp.asarray, quantize_int8(w, in_axis=-1))) for n, w in w_nk.items()},
        "onednn bf16": {n: jnp.asarray(w, jnp.bfloat16) for n, w in w_nk.items()},
    }
    matmul = {
        "xla f32": None,  # the scan slices: x @ w
        "int8 kernel": lambda x, qs, l: int8_kernel.int8_matmul(x, *qs, l),
        "onednn bf16": bf16_mm,
    }

    def layer(mm, h: jax.Array) -> jax.Array:
        q, k, v = mm("q", h), mm("k", h), mm("v", h)
        h = h + mm("o", q + jnp.tile(k + v, (1, 3)))
        x = h / jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)  # keep 30 layers finite
        return h + mm("d", jax.nn.silu(mm("g", x)) * mm("u", x))

    def model(name: str):
        if matmul[name] is None:
            return jax.jit(lambda x, W: jax.lax.scan(
                lambda h, w: (layer(lambda n, a: a @ w[n], h), None), x, W)[0])
        fn = matmul[name]
        return jax.jit(lambda x, W: jax.lax.scan(
            lambda h, l: (layer(lambda n, a: fn(a, W[n], l), h), None), x, jnp.arange(L, dtype=jnp.int32))[0])

    # The oneDNN product against its reference on one layer first.
    x = jnp.asarray(rng.standard_normal((5, H), np.float32))
    got = bf16_mm(x, stacks["onednn bf16"]["g"], jnp.int32(7))
    ref = x.astype(jnp.bfloat16).astype(jnp.float32) @ jnp.asarray(w32["g"][7], jnp.bfloat16).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(got - ref)))
    assert err < 1e-4, f"onednn bf16 matmul disagrees with its reference by {err}"
    print(f"onednn bf16 vs float32 dot of the bf16-rounded operands: max |diff| {err:.1e}")

    def bench(f, *a, reps: int = 10) -> float:
        f(*a).block_until_ready()
        t = time.perf_counter()
        for _ in range(reps):
            r = f(*a)
        r.block_until_ready()
        return (time.perf_counter() - t) / reps * 1e3

    fns = {name: model(name) for name in stacks}
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, H), np.float32))
        ms = {name: bench(fns[name], x, stacks[name]) for name in stacks}
        ref = np.asarray(fns["xla f32"](x, stacks["xla f32"]))
        drift = {n: float(np.max(np.abs(np.asarray(fns[n](x, stacks[n])) - ref)) / np.max(np.abs(ref)))
                 for n in stacks if n != "xla f32"}
        print(f"{rows:4d} rows: " + "  ".join(f"{n} {t:7.2f} ms" for n, t in ms.items())
              + f"  | f32/bf16 {ms['xla f32'] / ms['onednn bf16']:.2f}x"
              + "  | 30-layer drift vs f32: " + ", ".join(f"{n} {d:.1e}" for n, d in drift.items()),
              flush=True)


if __name__ == "__main__":
    main()
