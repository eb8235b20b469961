"""The CPU int8 matmul kernel beside its XLA reference (kernels_pallas.int8_matmul)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.int8_matmul import (
    CPU_KERNEL_MAX_TOKENS,
    cpu,
    cpu_kernel_applies,
    int8_matmul,
    int8_matmul_reference,
)

ROOT = Path(__file__).resolve().parents[2]


def operands(rng: np.random.Generator, m: int, n: int, k: int, groups: int, layers: int | None = None):
    lead = () if layers is None else (layers,)
    q = rng.integers(-127, 128, (*lead, n, k), dtype=np.int8)
    s = rng.uniform(0.5, 2.0, (*lead, n, groups)).astype(np.float32) / 127
    x = rng.standard_normal((m, k)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(q), jnp.asarray(s)


def numpy_matmul(x, q, s) -> np.ndarray:
    """float64 ground truth: dequantize in NumPy and multiply."""
    q, s = np.asarray(q, np.float64), np.asarray(s, np.float64)
    n, k = q.shape
    w = (q.reshape(n, s.shape[1], -1) * s[..., None]).reshape(n, k)
    return np.asarray(x, np.float64) @ w.T


def test_kernel_builds_here():
    # CI machines have g++ and AVX2: a build failure must be loud, not a silent fallback.
    assert cpu.available(), cpu.unavailable_reason()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 33])
@pytest.mark.parametrize("n,k,groups", [(200, 128, 2), (1000, 576, 9), (24, 96, 1)])
def test_kernel_equals_reference(m, n, k, groups):
    x, q, s = operands(np.random.default_rng(m * n), m, n, k, groups)
    layer = jnp.zeros((), jnp.int32)
    got = jax.jit(lambda *a: int8_matmul(*a, backend="cpu"))(x, q, s)
    ref = int8_matmul_reference(x, q, s, layer)
    truth = numpy_matmul(x, q, s)
    scale = np.abs(truth).max()
    assert np.abs(np.asarray(got) - truth).max() <= 1e-5 * scale
    assert np.abs(np.asarray(ref) - truth).max() <= 1e-5 * scale


def test_stacked_layers_in_a_scan_read_the_indexed_layer():
    # The layer scan passes the whole [L, N, K] stack and the index, never a slice.
    x, q, s = operands(np.random.default_rng(0), 3, 64, 128, 2, layers=4)

    def run(backend: str) -> jax.Array:
        def body(h, i):
            return h, int8_matmul(h, q, s, i, backend=backend)
        return jax.lax.scan(body, x, jnp.arange(4, dtype=jnp.int32))[1]

    got = jax.jit(lambda: run("cpu"))()
    for i in range(4):
        truth = numpy_matmul(x, q[i], s[i])
        np.testing.assert_allclose(np.asarray(got[i]), truth, atol=1e-5 * np.abs(truth).max())
    np.testing.assert_allclose(np.asarray(jax.jit(lambda: run("reference"))()), np.asarray(got),
                               atol=1e-5 * float(jnp.abs(got).max()))


def test_leading_dims_and_auto_choice():
    x, q, s = operands(np.random.default_rng(1), 6, 64, 128, 2)
    x3 = x.reshape(2, 3, 128)
    out = int8_matmul(x3, q, s)
    assert out.shape == (2, 3, 64)
    np.testing.assert_allclose(np.asarray(out).reshape(6, 64), numpy_matmul(x, q, s), rtol=0,
                               atol=1e-5 * np.abs(numpy_matmul(x, q, s)).max())
    assert cpu_kernel_applies(x, q, s)
    big = jnp.zeros((CPU_KERNEL_MAX_TOKENS + 1, 128), jnp.float32)
    assert not cpu_kernel_applies(big, q, s)
    hlo = jax.jit(lambda x: int8_matmul(x, q, s)).lower(x).as_text()
    assert cpu.TARGET in hlo
    assert cpu.TARGET not in jax.jit(lambda x: int8_matmul(x, q, s)).lower(big).as_text()
    assert not cpu_kernel_applies(x.astype(jnp.bfloat16), q, s)  # float32 activations only


def _lowered(f, platform: str, *args) -> str:
    """`f`'s program exported for `platform` (Triton calls allowed, as scripts/export_step.py)."""
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    return jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(*args).mlir_module()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_export_for_accelerators_leaves_out_the_cpu_kernel(platform):
    x, q, s = operands(np.random.default_rng(2), 1, 64, 128, 2)
    assert cpu.TARGET not in _lowered(lambda x, q, s: int8_matmul(x, q, s), platform, x, q, s)


def test_bad_arguments_raise_value_errors():
    x, q, s = operands(np.random.default_rng(3), 2, 64, 128, 2)
    with pytest.raises(ValueError, match="backend"):
        int8_matmul(x, q, s, backend="avx512")
    with pytest.raises(ValueError, match="layer"):
        int8_matmul(x, q[None], s[None])
    with pytest.raises(ValueError, match="layer"):
        int8_matmul(x, q, s, 0)
    x40, q40, s40 = operands(np.random.default_rng(4), 2, 8, 40, 1)
    with pytest.raises(ValueError, match="multiple of 32"):
        int8_matmul(x40, q40, s40, backend="cpu")
    with pytest.raises(ValueError, match="shapes disagree"):  # a scale stack of other depth
        int8_matmul(x, jnp.stack([q] * 4), jnp.stack([s]), 3, backend="cpu")
    with pytest.raises(ValueError, match="must be int8"):
        int8_matmul(x, q.astype(jnp.uint8), s, backend="cpu")
    assert not cpu_kernel_applies(x, q.astype(jnp.uint8), s)  # "auto": the reference takes it
    # "auto" falls back to the reference for shapes the kernel does not take.
    np.testing.assert_allclose(np.asarray(int8_matmul(x40, q40, s40)), numpy_matmul(x40, q40, s40),
                               rtol=1e-5, atol=1e-4)


def test_concurrent_calls_from_several_threads():
    # The kernel's thread pool runs one call at a time; callers from other threads wait.
    rng = np.random.default_rng(5)
    cases = [operands(rng, m, 512, 256, 4) for m in (1, 3, 8, 16)]
    f = jax.jit(lambda *a: int8_matmul(*a, backend="cpu"))
    errors: list[BaseException] = []

    def worker(x, q, s):
        try:
            truth = numpy_matmul(x, q, s)
            for _ in range(20):
                np.testing.assert_allclose(np.asarray(f(x, q, s)), truth, rtol=0,
                                           atol=1e-5 * np.abs(truth).max())
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_without_a_compiler_auto_uses_the_reference(tmp_path):
    # A machine with no C++ compiler: no build, a warning, and the XLA path still answers.
    code = """
import jax.numpy as jnp, numpy as np
from kernels_pallas.int8_matmul import cpu, int8_matmul, cpu_kernel_applies
x = jnp.ones((1, 64)); q = jnp.ones((8, 64), jnp.int8); s = jnp.full((8, 1), 0.5)
assert not cpu.available()
assert cpu.unavailable_reason().startswith("no C++ compiler"), cpu.unavailable_reason()
assert not cpu_kernel_applies(x, q, s)
assert np.allclose(np.asarray(int8_matmul(x, q, s)), 32.0)
print("fallback ok")
"""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "KERNELS_PALLAS_CACHE": str(tmp_path),
           "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "fallback ok" in run.stdout
    assert "CPU int8 kernel unavailable" in run.stderr


def small_int_operands(seed: int, values: str, m: int, n: int, k: int, groups: int):
    """bf16 x [m, k] and 3 stacked layers of values in [-7, 7] (exact in int4, int8 and fp8)
    with scales [3, n, groups]: the accelerator kernels' operands."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.integers(-7, 8, (3, n, k)), jnp.float32).astype(jnp.dtype(values))
    s = jnp.asarray(rng.uniform(0.01, 0.1, (3, n, groups)), jnp.float32)
    return jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16), q, s


@pytest.mark.parametrize("values,groups,k,m", [
    ("int8", 1, 512, 5), ("int8", 8, 512, 16), ("int4", 4, 512, 33), ("float8_e4m3fn", 2, 512, 3),
    ("float8_e4m3fn", 1, 512, 40), ("int8", 128, 8192, 2)])  # the last: scales [N, G] as they lie
def test_tpu_kernel_equals_float64_in_interpret_mode(values: str, groups: int, k: int, m: int) -> None:
    """The TPU kernel (kernels_pallas/int8_matmul/tpu.py) on a stacked [L, N, K] weight at a
    layer index, run by Pallas' interpreter: within bf16 rounding of the float64 product, as
    the XLA reference is (the kernel scales float32 partial products per group)."""
    from kernels_pallas.int8_matmul import tpu

    x, q, s = small_int_operands(3, values, m, 256, k, groups)
    assert tpu.why_not(x, q, s) is None
    truth = numpy_matmul(np.asarray(x, np.float64), np.asarray(q[1].astype(jnp.float32)), s[1])
    got = np.asarray(tpu.int8_matmul_tpu(x, q, s, jnp.int32(1), interpret=True), np.float64)
    ref = np.asarray(int8_matmul_reference(x, q, s, jnp.int32(1)), np.float64)
    scale = np.abs(truth).max()
    assert np.abs(got - truth).max() <= 2 ** -8 * scale
    assert np.abs(got - truth).max() <= np.abs(ref - truth).max() * 1.01 + 1e-6 * scale
    assert tpu.why_not(x, q[..., :200], s[..., :1]) is not None  # K not a multiple of the lanes


@pytest.mark.parametrize("values,groups,m", [("int8", 1, 5), ("int8", 8, 16), ("float8_e4m3fn", 2, 33),
                                              ("int8", 2, 130),  # 130: three blocks of tokens
                                              ("int4", 4, 17), ("int4", 1, 3)])
def test_gpu_kernel_equals_float64_in_interpret_mode(values: str, groups: int, m: int) -> None:
    """The GPU kernel (kernels_pallas/int8_matmul/gpu.py, Triton) by Pallas' interpreter, as
    the TPU kernel's test; groups of 64 inputs (the int8 format's) included."""
    from kernels_pallas.int8_matmul import gpu

    x, q, s = small_int_operands(5, values, m, 128, 512, groups)
    assert gpu.why_not(x, q, s) is None
    truth = numpy_matmul(np.asarray(x, np.float64), np.asarray(q[2].astype(jnp.float32)), s[2])
    got = np.asarray(gpu.int8_matmul_gpu(x, q, s, jnp.int32(2), interpret=True), np.float64)
    assert np.abs(got - truth).max() <= 2 ** -8 * np.abs(truth).max()
    assert gpu.why_not(x, q[..., :496].astype(jnp.int4), s[..., :1]) is not None  # K / 2 not 16 rows


def test_accelerator_exports_run_their_kernels_where_they_apply() -> None:
    """Lowered for a TPU or a GPU (from this CPU process), `auto` puts the platform's kernel in
    the program for the shapes it takes and the XLA reference otherwise."""
    def lowered(platform: str, n: int, m: int = 4) -> str:
        x, q, s = operands(np.random.default_rng(4), m, n, 256, 2, layers=2)
        return _lowered(lambda x, q, s: int8_matmul(x.astype(jnp.bfloat16), q, s, 1), platform, x, q, s)

    assert "tpu_custom_call" in lowered("tpu", 256) and "tpu_custom_call" not in lowered("tpu", 200)
    assert "triton" in lowered("cuda", 256) and "triton" not in lowered("cuda", 200)
