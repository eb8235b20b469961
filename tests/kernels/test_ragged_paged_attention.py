"""Every registered backend against the jax.numpy reference, in interpret mode on the CPU.

The axes are covered as a rotation, not a full cross product (interpret mode is slow): each
batch shape runs under two configurations, and the six configurations together hold every
GQA ratio (1, 3, 8), head_dim (64, 128), page size (16, 32) and dtype (f32, bf16), so every
backend sees every value of every axis, and every batch shape in both dtypes. The second
configuration of each shape also uses the backend's small test tuning (several q blocks and
kv blocks even for tiny batches). Unused cache slots are NaN (see batches.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas import AttentionSpec
from kernels_pallas.ragged_paged_attention.reference import ragged_paged_attention as reference

from .batches import make_batch, tolerance

BF16 = ml_dtypes.bfloat16


def _cases(p: int) -> dict[str, list[tuple[int, int]]]:
    """Batch shapes as (q_len, kv_len) per sequence, relative to the page size p."""
    return {
        "decode_only": [(1, 2 * p + 3), (1, 1), (1, p), (1, 3 * p - 1)],
        "prefill_only": [(p + 5, p + 5), (7, 7), (2 * p, 2 * p)],
        "mixed": [(1, 2 * p + 1), (p - 4, p - 4), (1, 5), (9, 9)],
        "chunked_prefill": [(10, 2 * p + 13), (p, 2 * p), (5, 3 * p + 1)],
        "one_token": [(1, 1)],
        "page_boundaries": [(p, p), (1, p + 1), (p + 1, 2 * p), (1, 2 * p)],
    }


CASES = list(_cases(16))
# (num_q_heads, num_kv_heads), head_dim, page_size, dtype; in pairs (f32, bf16).
CONFIGS = [
    ((2, 2), 64, 16, np.float32), ((6, 2), 128, 32, BF16),
    ((8, 1), 128, 16, np.float32), ((2, 2), 128, 32, BF16),
    ((6, 2), 64, 32, np.float32), ((8, 1), 64, 16, BF16),
]


def _config_id(config) -> str:
    (hq, hkv), d, p, dtype = config
    return f"gqa{hq // hkv}-d{d}-p{p}-{np.dtype(dtype).name}"


PARAMS = [
    pytest.param(backend, case, CONFIGS[(2 * i + k) % 6], k,
                 id=f"{backend}-{case}-{_config_id(CONFIGS[(2 * i + k) % 6])}")
    for backend in kernels_pallas.list_backends()
    for i, case in enumerate(CASES)
    for k in range(2)
]


@functools.cache
def _reference_jit():
    return jax.jit(reference, static_argnames=("spec",))


def _run(backend_name: str, batch, tuning_index: int, spec: AttentionSpec,
         sinks: jax.Array | None = None) -> np.ndarray:
    backend = kernels_pallas.get_backend(backend_name)
    tuning = backend.test_tuning[tuning_index % len(backend.test_tuning)]
    out = kernels_pallas.ragged_paged_attention(
        *batch.args, spec=spec, sinks=sinks, backend=backend_name, interpret=True, tuning=tuning)
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("backend,case,config,tuning_index", PARAMS)
def test_matches_reference(backend: str, case: str, config, tuning_index: int) -> None:
    (num_q_heads, num_kv_heads), head_dim, page_size, dtype = config
    batch = make_batch(_cases(page_size)[case], num_q_heads=num_q_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                       dtype=dtype, seed=tuning_index)
    spec = AttentionSpec(sm_scale=head_dim ** -0.5)
    got = _run(backend, batch, tuning_index, spec)
    want = np.asarray(_reference_jit()(*batch.args, spec=spec), np.float32)
    n = batch.num_real_tokens  # padding rows are unspecified: ignored
    assert np.isfinite(got[:n]).all(), "NaN/inf in real rows: a read past kv_len or a bad page"
    np.testing.assert_allclose(got[:n], want[:n], **tolerance(dtype))


@pytest.mark.parametrize("backend", kernels_pallas.list_backends())
def test_sliding_window_and_soft_cap(backend: str) -> None:
    batch = make_batch(_cases(16)["chunked_prefill"] + [(1, 40)], num_q_heads=4,
                       num_kv_heads=2, head_dim=64, page_size=16, seed=4)
    spec = AttentionSpec(sm_scale=0.125, sliding_window=20, soft_cap=3.0)
    got = _run(backend, batch, 1, spec)
    want = np.asarray(_reference_jit()(*batch.args, spec=spec))
    n = batch.num_real_tokens
    np.testing.assert_allclose(got[:n], want[:n], **tolerance(np.float32))


@pytest.mark.parametrize("backend,tuning_index", [
    (backend, i) for backend in kernels_pallas.list_backends()
    for i in range(len(kernels_pallas.get_backend(backend).test_tuning))])
def test_attention_sinks(backend: str, tuning_index: int) -> None:
    """GPT-OSS's sinks, with a window and GQA, on every variant and tuning (the CPU's: its
    C++ kernels and its XLA loops), decode and prefill rows in one batch."""
    batch = make_batch(_cases(16)["mixed"] + [(1, 40)], num_q_heads=6, num_kv_heads=2,
                       head_dim=64, page_size=16, seed=7)
    sinks = jnp.asarray([0.5, -2.0, 4.0, -30.0, 1.0, 0.0], jnp.float32)
    spec = AttentionSpec(sm_scale=0.125, sliding_window=20)
    got = _run(backend, batch, tuning_index, spec, sinks=sinks)
    want = np.asarray(reference(*batch.args, spec=spec, sinks=sinks))
    n = batch.num_real_tokens
    np.testing.assert_allclose(got[:n], want[:n], **tolerance(np.float32))
    plain = np.asarray(reference(*batch.args, spec=spec))
    assert not np.allclose(want[:n], plain[:n], atol=1e-3)  # the sinks took their share


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("backend", kernels_pallas.list_backends())
def test_update_kv_cache(backend: str, dtype) -> None:
    """Every backend's KV write equals the XLA scatter; padding duplicates on page 0 are OK."""
    num_pages, page_size, num_kv_heads, head_dim = 5, 16, 2, 64
    rng = np.random.default_rng(1)
    cache = rng.standard_normal((num_pages, page_size, 2 * num_kv_heads, head_dim)).astype(dtype)
    num_tokens = 19
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(dtype)
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(dtype)
    real = rng.choice(np.arange(page_size, num_pages * page_size), 15, replace=False)
    slots = np.concatenate([real, [0, 0, 3, 0]]).astype(np.int32)  # 4 padding tokens
    want = np.asarray(cache).copy()
    for t, slot in enumerate(real):
        want[slot // page_size, slot % page_size, 0::2] = k[t]
        want[slot // page_size, slot % page_size, 1::2] = v[t]
    write = jax.jit(functools.partial(kernels_pallas.update_kv_cache, backend=backend,
                                      interpret=True), donate_argnums=0)
    got = np.asarray(write(jnp.asarray(cache), k, v, slots))
    np.testing.assert_array_equal(got[1:], want[1:])  # page 0 (null) holds garbage


@pytest.mark.parametrize("backend", kernels_pallas.list_backends())
def test_fp8_cache_with_scales(backend: str) -> None:
    """An fp8 (e4m3) cache, vLLM's layout (uint8 holding the bits of k / k_scale, v / v_scale):
    every backend reads the values and applies the scales as the reference does on an fp8
    array, and the result stays near the float32 cache's."""
    batch = make_batch(_cases(16)["mixed"], num_q_heads=4, num_kv_heads=2, head_dim=64,
                       page_size=16, seed=5)
    k_scale, v_scale = 0.5, 0.25
    pages = np.asarray(batch.kv_pages, np.float32).copy()
    pages[:, :, 0::2] /= k_scale
    pages[:, :, 1::2] /= v_scale
    fp8 = jnp.asarray(pages).astype(jnp.float8_e4m3fn)
    bits = jax.lax.bitcast_convert_type(fp8, jnp.uint8)
    spec = AttentionSpec(sm_scale=0.125, k_scale=k_scale, v_scale=v_scale)
    got = _run_args(backend, (batch.q, bits, *batch.args[2:]),
                    dataclasses.replace(spec, kv_cache_dtype="fp8_e4m3"))
    want = np.asarray(_reference_jit()(batch.q, fp8, *batch.args[2:], spec=spec))
    n = batch.num_real_tokens
    assert np.isfinite(got[:n]).all()
    np.testing.assert_allclose(got[:n], want[:n], **tolerance(np.float32))
    exact = np.asarray(_reference_jit()(*batch.args, spec=AttentionSpec(sm_scale=0.125)))
    np.testing.assert_allclose(got[:n], exact[:n], atol=0.1, rtol=0.1)  # e4m3: 3 mantissa bits


def _run_args(backend_name: str, args, spec: AttentionSpec) -> np.ndarray:
    tuning = kernels_pallas.get_backend(backend_name).test_tuning[0]
    out = kernels_pallas.ragged_paged_attention(*args, spec=spec, backend=backend_name,
                                                interpret=True, tuning=tuning)
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("backend", kernels_pallas.list_backends())
def test_scaled_fp8_kv_write_stores_bits_of_k_over_k_scale(backend: str) -> None:
    cache = jnp.zeros((3, 16, 4, 64), jnp.uint8)
    rng = np.random.default_rng(2)
    k, v = (rng.standard_normal((5, 2, 64)).astype(np.float32) for _ in range(2))
    slots = np.arange(16, 21, dtype=np.int32)
    got = kernels_pallas.update_kv_cache(cache, k, v, slots, k_scale=2.0, v_scale=0.5,
                                         kv_cache_dtype="fp8", backend=backend, interpret=True)
    assert got.dtype == jnp.uint8
    values = jax.lax.bitcast_convert_type(got, jnp.float8_e4m3fn)
    rows = np.asarray(values.astype(jnp.float32))[1, :5]
    np.testing.assert_allclose(rows[:, 0::2], k / 2.0, rtol=0.07, atol=1e-2)
    np.testing.assert_allclose(rows[:, 1::2], v / 0.5, rtol=0.07, atol=1e-2)


# Tunings of the gpu kernel that compile for H100 / H200 at these head shapes
# (docs/gpu_tunings.md): the smallest tiles, the default, the widest warps and stages.
GPU_TUNINGS = [dict(block_q=1, pages_per_block=1), dict(block_q=2, pages_per_block=1),
               dict(block_q=8, pages_per_block=4), dict(block_q=8, pages_per_block=8, num_warps=8,
                                                        num_stages=3),
               dict(block_q=16, pages_per_block=8, num_warps=8), dict(block_q=32, pages_per_block=2)]


@pytest.mark.parametrize("tuning", GPU_TUNINGS, ids=lambda t: "-".join(f"{k}{v}" for k, v in t.items()))
def test_gpu_tunings_that_compile_are_correct(tuning) -> None:
    from kernels_pallas.ragged_paged_attention import gpu

    gpu.check_tuning(**{"num_warps": 4, "num_stages": 2, **tuning})  # the guard accepts it
    batch = make_batch(_cases(16)["mixed"] + _cases(16)["chunked_prefill"], num_q_heads=8,
                       num_kv_heads=2, head_dim=128, page_size=16, dtype=BF16, seed=11)
    spec = AttentionSpec(sm_scale=128 ** -0.5)
    got = kernels_pallas.ragged_paged_attention(*batch.args, spec=spec, backend="gpu",
                                                interpret=True, tuning=gpu.GpuTuning(**tuning))
    want = _reference_jit()(*batch.args, spec=spec)
    n = batch.num_real_tokens
    np.testing.assert_allclose(np.asarray(got, np.float32)[:n], np.asarray(want, np.float32)[:n],
                               **tolerance(BF16))


def test_gpu_guard_bounds_warps_and_keeps_small_tiles() -> None:
    from kernels_pallas.ragged_paged_attention import gpu

    with pytest.raises(ValueError, match="32 \\* num_warps <= 1024"):
        gpu.check_tuning(block_q=8, pages_per_block=4, num_warps=64, num_stages=2)
    with pytest.raises(ValueError, match="powers of two"):
        gpu.check_tuning(block_q=3, pages_per_block=4, num_warps=4, num_stages=2)
    gpu.check_tuning(block_q=1, pages_per_block=1, num_warps=4, num_stages=2)  # compiles: kept


def test_step_cost_counts_the_blocks_each_kernel_reads() -> None:
    """`step_cost` against hand counts of each kernel's plan: 9 q / 3 kv heads of 64 (the
    default model), bf16, pages of 16."""
    tpu, gpu = kernels_pallas.get_backend("tpu"), kernels_pallas.get_backend("gpu")
    packed = kernels_pallas.kv_cache_layout(3, 64, "bfloat16", backend="tpu")
    standard = kernels_pallas.kv_cache_layout(3, 64, "bfloat16", backend="gpu")
    # TPU: q blocks of 32 tokens, kv blocks of 8 pages = 128 keys; a packed token is
    # 3 x [k | v | pad] of 128 lanes in bf16: 1,024 B (768 B of values).
    assert packed.bytes_per_token() == 1024 and standard.bytes_per_token() == 768
    # Two decodes at 100 keys: one kv block each (the 28 past the end read the null page);
    # every row of the 32-token q block (x3 q heads) multiplies each block.
    assert tpu.step_cost(packed, 9, 16, [1, 1], [100, 100]) == (2 * 128 * 1024, 2 * 3 * 4 * 96 * 128 * 128)
    # A 100-token prefill: 4 q blocks, each needs keys up to its last token (<= 128): 4 blocks.
    assert tpu.step_cost(packed, 9, 16, [100], [100])[0] == 4 * 128 * 1024
    # GPU: q blocks of 8 tokens (group 3 padded to 4), kv blocks of 4 pages = 64 keys.
    # Decodes at 100 keys: 2 blocks each, per kv head.
    assert gpu.step_cost(standard, 9, 16, [1, 1], [100, 100]) == (4 * 64 * 768, 4 * 3 * 4 * 32 * 64 * 64)
    # The prefill: 13 work items; those ending at <= 64 keys (8) read one block, the rest 2.
    assert gpu.step_cost(standard, 9, 16, [100], [100])[0] == (8 + 5 * 2) * 64 * 768


@pytest.mark.parametrize("field,value", [
    ("sm_scale", 0.0), ("sm_scale", jnp.float32(0.1)), ("sliding_window", 0),
    ("sliding_window", 2.5), ("soft_cap", -1.0), ("k_scale", 0.0), ("v_scale", float("nan")),
    ("mask_value", float("-inf")), ("mask_value", 1.0), ("kv_cache_dtype", "int4"),
    ("layout", "packed"),
])
def test_attention_spec_names_the_bad_field(field: str, value) -> None:
    fields = {"sm_scale": 0.125, field: value}
    with pytest.raises(ValueError, match=f"AttentionSpec.{field}"):
        AttentionSpec(**fields)


def test_attention_spec_is_a_static_argument() -> None:
    """Equal specs hash equal (one compile), numpy numbers included; a record differs from
    another by its math only."""
    spec = AttentionSpec(sm_scale=np.float64(0.125), sliding_window=np.int32(20))
    assert spec == AttentionSpec(sm_scale=0.125, sliding_window=20)
    assert hash(spec) == hash(AttentionSpec(sm_scale=0.125, sliding_window=20))
    assert type(spec.sm_scale) is float and type(spec.sliding_window) is int
    assert {spec, dataclasses.replace(spec, soft_cap=3.0)} != {spec}


def test_every_variant_takes_the_same_contract() -> None:
    """The registry's promise: every variant's attention takes `spec=`, `sinks=`, `plan=`,
    `interpret=`, `tuning=` (what tests/kernels and the dispatcher pass), and its test tunings
    are frozen, hashable records of one type."""
    import inspect

    for name in kernels_pallas.list_backends():
        backend = kernels_pallas.get_backend(name)
        params = inspect.signature(backend.attention).parameters
        assert {"spec", "sinks", "plan", "interpret", "tuning"} <= set(params), name
        records = [t for t in backend.test_tuning if t is not None]
        assert len({type(t) for t in records}) <= 1, name
        for t in records:
            assert dataclasses.is_dataclass(t) and hash(t) is not None, name
