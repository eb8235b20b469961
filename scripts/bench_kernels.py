"""Time every ragged paged-attention backend on decode-heavy and prefill-heavy batches.

    python scripts/bench_kernels.py                     # all backends that run here
    python scripts/bench_kernels.py --backends gpu --iters 50

Prints, per batch and backend: time, achieved HBM bandwidth (bytes that must move at least
once: the context's K/V, q and the output) against the chip's peak, compute rate, and the
largest difference from the reference. For decode it also times JAX's own
`jax.experimental.pallas.ops.gpu.paged_attention` (GPU only, its own k/v layout) as a yardstick.

On a machine without a GPU or TPU it runs a tiny smoke configuration, with the Pallas kernels
in interpret mode, so the script itself stays tested; those figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels_pallas  # noqa: E402
from kernels_pallas.kv_cache import convert_cache, standard_layout  # noqa: E402

# Peak HBM bandwidth in bytes/s by `jax.devices()[0].device_kind` (prefix match, first wins).
PEAK_HBM_BYTES_PER_S = {
    "NVIDIA H200": 4.8e12,
    "NVIDIA H100 NVL": 3.9e12,
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA H100": 3.35e12,  # SXM
    "NVIDIA H800": 3.35e12,
    "NVIDIA B200": 8.0e12,
    "NVIDIA GB200": 8.0e12,
    "NVIDIA A100-SXM4-80GB": 2.04e12,
    "NVIDIA A100 80GB PCIe": 1.94e12,
    "NVIDIA A100": 1.56e12,  # 40GB
    "NVIDIA L40S": 0.864e12,
    "NVIDIA L4": 0.3e12,
    "NVIDIA RTX 6000 Ada": 0.96e12,
    "TPU v4": 1.2e12,
    "TPU v5 lite": 0.819e12,  # v5e
    "TPU v5p": 2.765e12,
    "TPU v5": 2.765e12,
    "TPU v6 lite": 1.64e12,  # v6e (Trillium)
    "TPU7x": 7.37e12,
}


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    num_seqs: int
    q_len: int  # per sequence
    kv_len: int  # per sequence, this step's tokens included
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "bfloat16"

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.q_len

    def bytes_moved(self) -> int:
        item = jnp.dtype(self.dtype).itemsize
        kv = self.num_seqs * self.kv_len * 2 * self.num_kv_heads * self.head_dim * item
        q_and_out = 2 * self.num_tokens * self.num_q_heads * self.head_dim * item
        return kv + q_and_out

    def flops(self) -> int:
        # Causal: query i of a chunk sees kv_len - q_len + i + 1 keys; 2 matmuls x 2 flops.
        seen = self.q_len * (self.kv_len - self.q_len) + self.q_len * (self.q_len + 1) // 2
        return 4 * self.num_seqs * seen * self.num_q_heads * self.head_dim


REAL = [
    Workload("decode 64 x 2k", num_seqs=64, q_len=1, kv_len=2048),
    Workload("decode 256 x 1k", num_seqs=256, q_len=1, kv_len=1024),
    Workload("prefill 8 x 512 (2k ctx)", num_seqs=8, q_len=512, kv_len=2048),
    Workload("prefill 2 x 2k", num_seqs=2, q_len=2048, kv_len=2048),
]
SMOKE = [
    Workload("decode (smoke)", num_seqs=4, q_len=1, kv_len=40, num_q_heads=8,
             num_kv_heads=2, head_dim=64, dtype="float32"),
    Workload("prefill (smoke)", num_seqs=2, q_len=24, kv_len=40, num_q_heads=8,
             num_kv_heads=2, head_dim=64, dtype="float32"),
]


def make_inputs(w: Workload, seed: int = 0) -> tuple[jax.Array, ...]:
    """A batch where every sequence owns its own pages (a shuffled page table)."""
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-w.kv_len // w.page_size)
    num_pages = w.num_seqs * pages_per_seq + 1  # + the null page
    dtype = jnp.dtype(w.dtype)
    q = jnp.asarray(rng.standard_normal((w.num_tokens, w.num_q_heads, w.head_dim)), dtype)
    kv = jax.random.normal(jax.random.key(seed),
                           (num_pages, w.page_size, 2 * w.num_kv_heads, w.head_dim), dtype)
    table = (1 + rng.permutation(w.num_seqs * pages_per_seq)).reshape(w.num_seqs, -1)
    return (q, kv,
            jnp.full((w.num_seqs,), w.kv_len, jnp.int32),
            jnp.asarray(table, jnp.int32),
            jnp.arange(w.num_seqs + 1, dtype=jnp.int32) * w.q_len,
            jnp.array([w.num_seqs], jnp.int32))


def time_fn(fn: Callable[[], jax.Array], iters: int) -> float:
    """Median seconds per call after a warm-up (which also compiles)."""
    jax.block_until_ready(fn())
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def jax_gpu_paged_attention(w: Workload, args, interpret: bool) -> Callable[[], jax.Array] | None:
    """JAX's decode-only GPU kernel on the same data, in its own [kvh, pages, P, D] layout."""
    if w.q_len != 1:
        return None
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa

    q, kv, kv_lens, table, _, _ = args
    k_pages = jnp.moveaxis(kv[:, :, 0::2], 2, 0)  # copied once, outside the timing
    v_pages = jnp.moveaxis(kv[:, :, 1::2], 2, 0)
    pages_per_seq = table.shape[1]
    k_splits = next(s for s in (16, 8, 4, 2, 1) if pages_per_seq % s == 0)
    per_block = next(b for b in (8, 4, 2, 1) if (pages_per_seq // k_splits) % b == 0)
    q = q * w.head_dim ** -0.5  # it takes no sm_scale; scaled outside the timing
    fn = jax.jit(lambda q, k, v, t, l: jax_pa.paged_attention(
        q, k, v, t, l, k_splits=k_splits, pages_per_compute_block=per_block,
        interpret=interpret))
    return lambda: fn(q, k_pages, v_pages, table, kv_lens)


def peak_bandwidth(device: jax.Device) -> float | None:
    kind = device.device_kind
    return next((v for k, v in PEAK_HBM_BYTES_PER_S.items() if kind.startswith(k)), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="*", default=None,
                        help="default: every backend that runs here, of "
                             f"{kernels_pallas.list_backends()}")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, even on a GPU/TPU")
    opts = parser.parse_args()

    device = jax.devices()[0]
    platform = {"gpu": "cuda"}.get(device.platform, device.platform)
    on_accelerator = platform in ("cuda", "rocm", "tpu")
    interpret = not on_accelerator
    names = opts.backends or [
        n for n in kernels_pallas.list_backends()
        if platform in kernels_pallas.get_backend(n).platforms
        or (interpret and kernels_pallas.get_backend(n).interpretable)
    ]
    workloads = SMOKE if (opts.smoke or not on_accelerator) else REAL
    iters = opts.iters if on_accelerator else 2
    peak = peak_bandwidth(device)
    print(f"device: {device.device_kind} ({platform}); peak HBM "
          f"{'unknown' if peak is None else f'{peak / 1e12:.2f} TB/s'}")
    if not on_accelerator:
        print("NOTE: no GPU/TPU here: tiny smoke sizes, Pallas kernels in interpret mode; "
              "the figures below are NOT meaningful.")

    header = (f"{'batch':26} {'backend':22} {'time':>10} {'GB/s':>9} {'% peak':>7} "
              f"{'TFLOP/s':>8} {'max err':>9}")
    print(header)
    print("-" * len(header))
    for w in workloads:
        args = make_inputs(w)
        scale = w.head_dim ** -0.5
        spec = kernels_pallas.AttentionSpec(sm_scale=scale)
        want = jax.jit(lambda *a: kernels_pallas.ragged_paged_attention(*a, spec=spec))(*args)
        runs: list[tuple[str, Callable[[], jax.Array]]] = []
        for name in names:
            bargs, layout = args, None
            if kernels_pallas.get_backend(name).packed_layout:  # its own layout, made once
                std = standard_layout(args[1])
                layout = dataclasses.replace(std, packed=True)
                bargs = (args[0], convert_cache(args[1], std, layout), *args[2:])
            fn = jax.jit(lambda *a, name=name, layout=layout: kernels_pallas.ragged_paged_attention(
                *a, spec=dataclasses.replace(spec, layout=layout), backend=name,
                interpret=interpret and name != "reference"))
            runs.append((name, lambda fn=fn, bargs=bargs: fn(*bargs)))
        if platform == "cuda" or (interpret and "gpu" in names):
            extra = jax_gpu_paged_attention(w, args, interpret)
            if extra is not None:
                runs.append(("jax.ops.gpu.paged_attn", extra))
        if platform == "tpu":  # JAX's own TPU kernel takes the standard layout (not interpretable)
            from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as jax_rpa

            upstream = jax.jit(lambda *a: jax_rpa(*a, sm_scale=scale))
            runs.append(("jax.ops.tpu.ragged_pa", lambda: upstream(*args)))
        for name, fn in runs:
            try:
                seconds = time_fn(fn, iters)
                err = float(jnp.max(jnp.abs(fn().astype(jnp.float32) - want.astype(jnp.float32))))
            except Exception as e:  # one broken variant must not hide the others' figures
                print(f"{w.name:26} {name:22} FAILED: {type(e).__name__}: {str(e)[:80]}")
                continue
            bw = w.bytes_moved() / seconds
            pct = f"{100 * bw / peak:6.1f}%" if peak else "    n/a"
            print(f"{w.name:26} {name:22} {seconds * 1e3:8.3f}ms {bw / 1e9:9.1f} {pct:>7} "
                  f"{w.flops() / seconds / 1e12:8.2f} {err:9.2e}")
    if not on_accelerator:
        print("(smoke run finished; rerun on a GPU or TPU for real figures)")


if __name__ == "__main__":
    main()
