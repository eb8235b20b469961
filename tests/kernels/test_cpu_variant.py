"""The CPU variant's own work split, beyond the shared parametrized test: its decode path
with several query tokens per sequence, one-token steps, long contexts beside short ones,
and a plan built once and shared by several calls (as the model's layers share it). Each
decode case runs through both decode paths: the C++ kernel (decode_cpu.cc) and the XLA loop;
the prefill kernel (prefill_cpu.cc) is checked against the float64 oracle with each of its
dot types this CPU runs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas import AttentionSpec
from kernels_pallas.ragged_paged_attention import _decode_cpu, _prefill_cpu, cpu

from .batches import make_batch, naive_attention, tolerance

BF16 = ml_dtypes.bfloat16

KERNELS = pytest.mark.parametrize("decode_kernel", ["auto", "xla"], ids=["cpp", "xla"])


def _check(seqs, *, num_tokens=None, dtype=np.float32, page_size=16, num_q_heads=6,
           num_kv_heads=2, soft_cap=None, sliding_window=None, **tuning) -> None:
    batch = make_batch(seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=64,
                       page_size=page_size, num_tokens=num_tokens, dtype=dtype, seed=len(seqs))
    spec = AttentionSpec(sm_scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap)
    fn = jax.jit(functools.partial(cpu.ragged_paged_attention, spec=spec,
                                   tuning=cpu.CpuTuning(**tuning)))
    got = np.asarray(fn(*batch.args), np.float32)
    want = naive_attention(batch, sm_scale=0.125, sliding_window=sliding_window,
                           soft_cap=soft_cap)
    n = batch.num_real_tokens
    assert np.isfinite(got[:n]).all()
    np.testing.assert_allclose(got[:n], want[:n], **tolerance(dtype))
    assert (got[n:] == 0).all()


def test_the_decode_kernel_builds_here() -> None:
    """The machines the suite runs on have g++ and AVX2: the C++ path is the one tested."""
    assert _decode_cpu.available(), _decode_cpu.unavailable_reason()


@KERNELS
def test_one_token_step(decode_kernel: str) -> None:
    _check([(1, 37)], num_tokens=1, decode_kernel=decode_kernel)


@KERNELS
def test_short_decodes_beside_a_long_one(decode_kernel: str) -> None:
    # 700 keys: the C++ kernel splits the row into three 256-key chunks and merges them.
    _check([(1, 700), (1, 3), (1, 17), (1, 1), (1, 64)], decode_items=2,
           decode_kernel=decode_kernel)


@KERNELS
@pytest.mark.parametrize("decode_q_len", [1, 4])
def test_multi_token_sequences_on_either_path(decode_q_len: int, decode_kernel: str) -> None:
    # q_len 3 and 4 go to the decode path when decode_q_len=4 (speculative-decoding shapes).
    _check([(3, 90), (4, 4), (1, 33), (20, 200)], decode_q_len=decode_q_len, block_q=8,
           decode_kernel=decode_kernel)


@KERNELS
def test_sliding_window_on_both_paths(decode_kernel: str) -> None:
    _check([(1, 300), (40, 260), (2, 50)], sliding_window=37, block_q=16, pages_per_block=2,
           decode_kernel=decode_kernel)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page_size,num_q_heads,num_kv_heads", [(16, 6, 2), (32, 8, 1), (8, 4, 4)])
def test_decode_kernel_cache_dtypes_pages_and_groups(dtype, page_size: int, num_q_heads: int,
                                                      num_kv_heads: int) -> None:
    """Windows that start inside a tile and cross a 256-key chunk, soft capping, every cache
    dtype the kernel reads, page sizes of one and several tiles, GQA groups 1 to 8."""
    _check([(1, 530), (1, 9), (1, 257), (1, 256)], dtype=dtype, page_size=page_size,
           num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, sliding_window=301, soft_cap=5.0)


def _decode_dots() -> list[str]:
    """The decode kernel's dot types over a bf16 cache that this CPU runs."""
    return ["float32"] + (["bfloat16"] if _decode_cpu.bf16_dots(BF16, 64, 16) else [])


@pytest.mark.parametrize("dots", _decode_dots())
def test_decode_kernel_dots_over_a_bf16_cache(dots: str) -> None:
    """Each dot type the kernel has for a bf16 cache (AVX512-BF16's where the CPU has it, the
    float32 FMAs everywhere) against the float64 oracle: windows starting inside a 16-key tile,
    soft capping, sinks, a group of 3 (the default model's), chunks merged."""
    batch = make_batch([(1, 530), (1, 9), (1, 257)], num_q_heads=9, num_kv_heads=3, head_dim=64,
                       page_size=16, num_tokens=3, dtype=BF16, seed=5)
    sinks = np.linspace(-3.0, 2.0, 9).astype(np.float32)
    row_seq, row_pos = jnp.arange(3, dtype=jnp.int32), jnp.asarray([529, 8, 256], jnp.int32)
    got = np.asarray(jax.jit(functools.partial(
        _decode_cpu.paged_decode_attention, sm_scale=0.125, soft_cap=5.0, sliding_window=301,
        sinks=sinks, dots=dots))(
        batch.q, batch.kv_pages, batch.page_indices, row_seq, row_pos, jnp.int32(3)))
    want = naive_attention(batch, sm_scale=0.125, sliding_window=301, soft_cap=5.0, sinks=sinks)
    np.testing.assert_allclose(got, want[:3], **tolerance(BF16))
    if dots == "float32":
        with pytest.raises(ValueError, match="bfloat16 cache"):
            _decode_cpu.paged_decode_attention(
                batch.q.astype(np.float32), np.asarray(batch.kv_pages, np.float32),
                batch.page_indices, row_seq, row_pos, jnp.int32(3), sm_scale=0.125,
                soft_cap=None, sliding_window=None, dots="bfloat16")


def test_decode_kernel_refuses_what_it_cannot_read() -> None:
    assert "fp8" in _decode_cpu.why_not(6, 2, 64, 16, np.uint8, "fp8_e4m3", True)
    assert "float16" in _decode_cpu.why_not(6, 2, 64, 16, np.float16, "float16", False)
    assert "page size" in _decode_cpu.why_not(6, 2, 64, 12, np.float32, "auto", False)
    assert "head_dim" in _decode_cpu.why_not(6, 2, 60, 16, np.float32, "auto", False)
    assert _decode_cpu.why_not(6, 2, 64, 16, np.float32, "auto", False) is None


def test_decode_kernel_name_is_checked() -> None:
    batch = make_batch([(1, 5)], num_q_heads=2, num_kv_heads=2, head_dim=64, page_size=16)
    with pytest.raises(ValueError, match="CpuTuning.decode_kernel"):
        cpu.ragged_paged_attention(*batch.args, spec=AttentionSpec(sm_scale=0.125),
                                   tuning=cpu.CpuTuning(decode_kernel="fast"))


def test_plan_built_once_serves_every_call() -> None:
    batch = make_batch([(5, 40), (1, 80), (1, 2)], num_q_heads=6, num_kv_heads=2, head_dim=64,
                       page_size=16, seed=3)
    spec = AttentionSpec(sm_scale=0.125)
    plan = cpu.make_plan(batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs,
                         num_tokens=batch.q.shape[0], page_size=16, spec=spec)
    with_plan = cpu.ragged_paged_attention(*batch.args, spec=spec, plan=plan)
    without = cpu.ragged_paged_attention(*batch.args, spec=spec)
    np.testing.assert_array_equal(np.asarray(with_plan), np.asarray(without))


def test_the_prefill_kernel_loads_where_the_cpu_has_avx512() -> None:
    """AVX-512 CPUs run it; an AVX2-only one keeps the XLA loop and says why (no SIGILL)."""
    flags = open("/proc/cpuinfo").read().split()
    if "avx512f" in flags and "avx512bw" in flags and "avx512vl" in flags and "avx512dq" in flags:
        assert _prefill_cpu.available(), _prefill_cpu.unavailable_reason()
        assert _prefill_cpu.bf16_dots(BF16) == ("avx512_bf16" in flags)
    else:
        assert not _prefill_cpu.available()
        assert "AVX-512" in _prefill_cpu.unavailable_reason()
    assert not _prefill_cpu.bf16_dots(np.float32)


def _prefill_dots() -> list:
    if not _prefill_cpu.available():
        return [pytest.param(None, marks=pytest.mark.skip(reason=_prefill_cpu.unavailable_reason()))]
    return [(np.float32, "float32"), (BF16, "float32")] + (
        [(BF16, "bfloat16")] if _prefill_cpu.bf16_dots(BF16) else [])


@pytest.mark.parametrize("cache_dots", _prefill_dots(), ids=lambda c: c and
                         f"{np.dtype(c[0]).name}-cache-{c[1]}-dots")
@pytest.mark.parametrize("page_size,num_q_heads,num_kv_heads,head_dim,window,soft_cap", [
    (16, 9, 3, 64, None, None), (8, 8, 1, 128, 45, None), (32, 4, 4, 64, 70, 5.0)])
def test_prefill_kernel(cache_dots, page_size: int, num_q_heads: int, num_kv_heads: int,
                        head_dim: int, window: int | None, soft_cap: float | None) -> None:
    """Prompts whole and chunked (q_len < kv_len), several query blocks and 32-key tiles, a
    window starting inside a tile, decode rows beside them (left 0), GQA groups 1 to 8."""
    dtype, dots = cache_dots
    seqs = [(70, 70), (1, 40), (37, 101), (3, 3), (1, 1), (50, 180)]
    batch = make_batch(seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, page_size=page_size, dtype=dtype, seed=page_size)
    plan = cpu.make_plan(batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs,
                         num_tokens=batch.q.shape[0], page_size=page_size,
                         spec=AttentionSpec(sm_scale=0.125))
    got = np.asarray(jax.jit(functools.partial(
        _prefill_cpu.paged_prefill_attention, sm_scale=0.125, soft_cap=soft_cap,
        sliding_window=window, decode_q_len=1, block_q=16, dots=dots))(
        np.asarray(batch.q, np.float32), batch.kv_pages, batch.page_indices, plan.cu,
        plan.q_lens, plan.kv_lens))
    want = naive_attention(batch, sm_scale=0.125, sliding_window=window, soft_cap=soft_cap)
    prefill = np.asarray(plan.valid & ~plan.decode_token)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[prefill], want[prefill],
                               **tolerance(np.float32 if dots == "float32" else BF16))
    assert (got[~prefill] == 0).all()
    if dots == "float32" and _prefill_cpu.bf16_dots(BF16) is False:
        with pytest.raises(ValueError, match="AVX512-BF16"):
            _prefill_cpu.paged_prefill_attention(
                batch.q, batch.kv_pages, batch.page_indices, plan.cu, plan.q_lens, plan.kv_lens,
                sm_scale=0.125, soft_cap=None, sliding_window=None, decode_q_len=1, block_q=16,
                dots="bfloat16")


def test_a_bf16_cache_kept_as_bits_is_written_in_place_and_read_by_both_paths() -> None:
    """The CPU variant's layout keeps bf16 as uint16 bits: XLA's CPU scatter into a bf16 array
    converts the whole cache to float32 and back each step (seconds at a real cache's size)."""
    import jax.numpy as jnp

    import kernels_pallas

    layout = kernels_pallas.kv_cache_layout(2, 64, "bfloat16", backend="cpu")
    assert layout.storage_dtype == jnp.uint16 and layout.stores_bits
    batch = make_batch([(20, 50), (1, 40), (1, 1)], num_q_heads=6, num_kv_heads=2, head_dim=64,
                       page_size=16, dtype=BF16, seed=5)
    bits = jax.lax.bitcast_convert_type(jnp.asarray(batch.kv_pages), jnp.uint16)
    want = naive_attention(batch, sm_scale=0.125)
    n = batch.num_real_tokens
    spec = AttentionSpec(sm_scale=0.125, layout=layout)
    for tuning in (cpu.CpuTuning(), cpu.CpuTuning(decode_kernel="xla", prefill_kernel="xla")):
        got = kernels_pallas.ragged_paged_attention(
            batch.q, bits, *batch.args[2:], spec=spec, backend="cpu", tuning=tuning)
        np.testing.assert_allclose(np.asarray(got, np.float32)[:n], want[:n], **tolerance(BF16))
    k = jnp.full((3, 2, 64), 1.5, jnp.float32)
    write = jax.jit(functools.partial(kernels_pallas.update_kv_cache, backend="cpu", layout=layout),
                    donate_argnums=0)
    slots = jnp.array([17, 18, 40], jnp.int32)
    hlo = write.lower(bits, k, -k, slots).compile().as_text()
    assert f"f32[{bits.shape[0]},16,4,64]" not in hlo, "the scatter converts the whole cache"
    out = write(bits, k, -k, slots)
    values = np.asarray(jax.lax.bitcast_convert_type(out, jnp.bfloat16), np.float32).reshape(-1, 4, 64)
    assert (values[[17, 18, 40]][:, 0::2] == 1.5).all() and (values[[17, 18, 40]][:, 1::2] == -1.5).all()
