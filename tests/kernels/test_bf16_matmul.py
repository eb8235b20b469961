"""The CPU bf16 matmuls (few-token kernel, oneDNN) beside their XLA reference
(kernels_pallas.bf16_matmul)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.bf16_matmul import (
    CPU_KERNEL_MAX_TOKENS,
    PACKED_FEW_TOKENS,
    bf16_matmul,
    bf16_matmul_packed,
    bf16_matmul_reference,
    cpu,
    cpu_path,
    pack_weights,
    packed_elements,
)


def operands(m: int, n: int, k: int, layers: int | None = None, seed: int = 0):
    rng = np.random.default_rng(seed)
    lead = () if layers is None else (layers,)
    w = jnp.asarray(rng.standard_normal((*lead, n, k)) / np.sqrt(k), jnp.bfloat16)
    return jnp.asarray(rng.standard_normal((m, k)), jnp.float32), w


def float64_matmul(x, w) -> np.ndarray:
    """Ground truth: the bf16 weights exactly, in float64."""
    return np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T


def test_kernel_builds_here():
    # CI machines have g++ and AVX2: a build failure must be loud, not a silent fallback.
    assert cpu.available(), cpu.unavailable_reason()


def test_onednn_comes_with_the_install_and_says_what_runs():
    # No apt package: `pip install -e .` brings oneDNN 3 and its headers on x86-64 Linux, and
    # the kernel links it from there on every CPU; its bf16 is used where the CPU has the units.
    include, lib = cpu.onednn_paths()
    assert (include / "oneapi" / "dnnl" / "dnnl.hpp").is_file() and (lib / "libdnnl.so.3").is_file()
    assert cpu.onednn_linked(), cpu.onednn_unavailable_reason()
    description = cpu.onednn_description()
    assert description.startswith("oneDNN 3."), description
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    native = bool({"avx512_bf16", "amx_bf16"} & flags)
    if "ONEDNN_MAX_CPU_ISA" not in os.environ:  # a user's cap on oneDNN hides the CPU's units
        assert cpu.onednn_available() == native, (description, cpu.onednn_unavailable_reason())
    if not cpu.onednn_available():  # the reason names the ISA, and a forced path is a clear error
        assert "neither AVX512-BF16 nor AMX" in cpu.onednn_unavailable_reason()
        x, w = operands(32, 64, 64)
        with pytest.raises(ValueError, match="onednn bf16 matmul cannot run here"):
            bf16_matmul(x, w, backend="onednn")


def test_a_cpu_without_bf16_units_falls_back_with_its_reason():
    # oneDNN's own cap on its instruction set stands in for an older CPU (an AVX2-only EPYC):
    # the kernel still builds and links, oneDNN reports avx2, and nothing takes its bf16 path.
    code = ("from kernels_pallas.bf16_matmul import cpu, packing_available; "
            "print(cpu.available(), cpu.onednn_available(), packing_available()); "
            "print(cpu.onednn_unavailable_reason())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-2000:]
    flags, reason = run.stdout.strip().splitlines()[-2:]
    assert flags == "True False False", run.stdout
    assert reason.startswith("oneDNN 3.") and "on avx2: this CPU has neither AVX512-BF16 nor AMX" in reason


def test_missing_onednn_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(cpu, "ONEDNN_HEADERS", ("onednn-devel-not-installed", "oneapi/dnnl/dnnl.hpp"))
    with pytest.raises(RuntimeError, match="pip install onednn-cpu-gomp onednn-devel-cpu-gomp"):
        cpu.onednn_paths()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 33])
def test_kernel_is_the_float32_product_of_the_bf16_weights(m: int):
    x, w = operands(m, 200, 576, layers=3)  # N not a multiple of the row chunk: a ragged tail
    got = jax.jit(lambda x, w: bf16_matmul(x, w, 2, backend="cpu"))(x, w)
    want = float64_matmul(x, w[2])
    assert got.dtype == jnp.float32 and got.shape == (m, 200)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5 * np.abs(want).max())
    ref = bf16_matmul_reference(x, w, jnp.int32(2))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=2e-5 * np.abs(want).max())


def test_layer_index_is_clamped_like_xla():
    x, w = operands(2, 64, 64, layers=3)
    for layer, like in ((7, 2), (-1, 0)):
        got = bf16_matmul(x, w, layer, backend="cpu")
        want = bf16_matmul_reference(x, w, jnp.int32(like))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_unstacked_weights_and_leading_dims():
    x, w = operands(6, 96, 128)
    got = bf16_matmul(x.reshape(2, 3, 128), w, backend="cpu")
    np.testing.assert_allclose(np.asarray(got).reshape(6, 96), float64_matmul(x, w), rtol=0, atol=1e-4)


onednn = pytest.mark.skipif(not cpu.onednn_available(),
                            reason=f"oneDNN bf16 unavailable: {cpu.onednn_unavailable_reason()}")


@onednn
@pytest.mark.parametrize("m", [1, 17, 64, 130])
def test_onednn_is_the_product_of_the_bf16_rounded_operands(m: int):
    x, w = operands(m, 192, 576, layers=2, seed=m)
    got = jax.jit(lambda x, w: bf16_matmul(x, w, 1, backend="onednn"))(x, w)
    want = float64_matmul(x.astype(jnp.bfloat16).astype(jnp.float32), w[1])
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-4 * np.abs(want).max())
    # Rounding the activations to bf16 moves the product by well under 1% of its range.
    full = float64_matmul(x, w[1])
    assert np.abs(np.asarray(got) - full).max() < 1e-2 * np.abs(full).max()


def test_auto_picks_by_token_count():
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU paths")
    w = operands(1, 64, 64, layers=2)[1]
    few = jnp.zeros((CPU_KERNEL_MAX_TOKENS, 64), jnp.float32)
    many = jnp.zeros((CPU_KERNEL_MAX_TOKENS + 1, 64), jnp.float32)
    assert cpu_path(few, w) == "cpu"
    assert cpu_path(many, w) == ("onednn" if cpu.onednn_available() else "reference")
    assert cpu_path(few.astype(jnp.bfloat16), w) == "reference"  # bf16 activations: XLA
    assert cpu_path(jnp.zeros((2, 48), jnp.float32), w[..., :48]) == "reference"  # K % 32


def test_inside_a_layer_scan_each_layer_is_read_in_place():
    x, w = operands(4, 64, 64, layers=5)
    layers = jnp.arange(5, dtype=jnp.int32)

    def run(backend: str) -> jax.Array:
        def step(h: jax.Array, l: jax.Array) -> tuple[jax.Array, None]:
            return jnp.tanh(bf16_matmul(h, w, l, backend=backend)), None

        return jax.jit(lambda h: jax.lax.scan(step, h, layers)[0])(x)

    np.testing.assert_allclose(np.asarray(run("auto")), np.asarray(run("reference")), rtol=1e-4, atol=1e-5)


def test_bad_calls_raise_value_errors():
    x, w = operands(2, 64, 64, layers=2)
    with pytest.raises(ValueError, match="backend"):
        bf16_matmul(x, w, 0, backend="fast")
    with pytest.raises(ValueError, match="layer is required"):
        bf16_matmul(x, w)
    with pytest.raises(ValueError, match="cannot run here: K=48"):
        bf16_matmul(x[:, :48], w[..., :48], 0, backend="cpu")
    with pytest.raises(ValueError, match="weights must be bfloat16"):
        bf16_matmul(x, w.astype(jnp.float32), 0, backend="cpu")


@onednn
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 16, 17, 64, 130])
@pytest.mark.parametrize("n,k", [(192, 576), (40, 96), (1000, 64)])  # 40, 1000 rows: padded blocks
def test_packed_weights_give_the_products(m: int, n: int, k: int):
    x, w = operands(m, n, k, layers=3, seed=m + n)
    packed = pack_weights(np.asarray(w))
    assert packed.shape == (3, packed_elements(n, k)) and packed.dtype == jnp.bfloat16
    assert packed.shape[-1] >= n * k
    got = jax.jit(lambda x, p: bf16_matmul_packed(x, p, n, 2))(x, jnp.asarray(packed))
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    # Either path (the few-token kernel up to PACKED_FEW_TOKENS, oneDNN beyond): the
    # activations rounded to bf16, float32 sums.
    want = float64_matmul(x.astype(jnp.bfloat16).astype(jnp.float32), w[2])
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-4 * np.abs(want).max())
    plain = bf16_matmul(x, w, 2, backend="onednn")
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain), rtol=0, atol=2e-5 * np.abs(want).max())
    # few_tokens=0: oneDNN at every row count.
    dnnl = bf16_matmul_packed(x, jnp.asarray(packed), n, 2, few_tokens=0)
    np.testing.assert_allclose(np.asarray(dnnl), np.asarray(bf16_matmul(x, w, 2, backend="onednn")),
                               rtol=0, atol=2e-5 * np.abs(want).max())


@onednn
def test_the_few_token_kernel_reads_the_layout_onednn_picks_here():
    # On AVX512-BF16 oneDNN blocks bf16 weights in 64 (or 32 / 48) output channels x 32
    # inputs, which the kernel reads; a CPU whose oneDNN picks another layout runs oneDNN
    # at every row count (correct, slower for few tokens): this test says so.
    if not cpu.avx512_bf16():
        pytest.skip("the few-token kernel on packed weights needs AVX512-BF16")
    with open("/proc/cpuinfo") as f:
        amx = "amx_bf16" in f.read()
    if amx and not cpu.few_token_kernel(576, 576):
        # Not yet seen: oneDNN's AMX matmul may block differently; then oneDNN runs every row count.
        pytest.skip("oneDNN's layout on this AMX CPU is not one the few-token kernel reads")
    assert cpu.few_token_kernel(576, 576) and cpu.few_token_kernel(49152, 576)
    assert not cpu.few_token_kernel(64, 48)  # K not a multiple of 32


@onednn
def test_packed_weights_run_on_the_bf16_units_at_every_row_count():
    # The layout is chosen at one row count; a row count whose fast path rejected it would
    # fall to oneDNN's reference implementation, correct but many times slower.
    for m in (1, 8, 64, 512):
        impl = cpu.packed_impl(m, 576, 576)
        assert "ref" not in impl, (m, impl)


@onednn
def test_packed_weights_in_a_layer_scan_and_unstacked():
    x, w = operands(5, 64, 64, layers=4)
    packed = jnp.asarray(pack_weights(np.asarray(w)))
    layers = jnp.arange(4, dtype=jnp.int32)

    def run(matmul) -> jax.Array:
        def step(h: jax.Array, l: jax.Array) -> tuple[jax.Array, None]:
            return jnp.tanh(matmul(h, l)), None

        return jax.jit(lambda h: jax.lax.scan(step, h, layers)[0])(x)

    want = run(lambda h, l: bf16_matmul(h, w, l, backend="onednn"))
    for few in (PACKED_FEW_TOKENS, 0):  # 5 tokens: the few-token kernel, or oneDNN
        got = run(lambda h, l: bf16_matmul_packed(h, packed, 64, l, few_tokens=few))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    one = bf16_matmul_packed(x[None], jnp.asarray(pack_weights(np.asarray(w[1]))), 64)
    np.testing.assert_allclose(np.asarray(one[0]), np.asarray(bf16_matmul(x, w, 1, backend="onednn")),
                               rtol=1e-5, atol=1e-6)


@onednn
def test_packed_bad_calls_raise_value_errors():
    x, w = operands(2, 64, 64, layers=2)
    packed = jnp.asarray(pack_weights(np.asarray(w)))
    with pytest.raises(ValueError, match="layer is required"):
        bf16_matmul_packed(x, packed, 64)
    with pytest.raises(ValueError, match=r"not \[128, 64\]"):
        bf16_matmul_packed(x, packed, 128, 0)
    with pytest.raises(ValueError, match="bf16 weights"):
        pack_weights(np.asarray(w, np.float32))
