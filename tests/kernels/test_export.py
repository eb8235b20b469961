"""Every backend lowers for its target platforms, checked on the CPU with jax.export.

Export runs the Triton / Mosaic lowering (not the device compiler), so a change that breaks
lowering (a non-power-of-two Triton tile, an op Mosaic cannot lower, a wrong BlockSpec) fails
here rather than on the first GPU or TPU machine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import kernels_pallas

# Pallas/Triton kernels are a custom call that jax.export does not promise to keep stable.
DISABLED_CHECKS = {
    "cuda": [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    "tpu": [],
}

SHAPES = {
    # name: (num_tokens, num_q_heads, num_kv_heads, head_dim, num_pages, page_size, max_seqs,
    #        pages_per_seq, dtype, options)
    "llama8b_bf16": (256, 32, 8, 128, 4096, 16, 64, 128, jnp.bfloat16, {}),
    "gqa3_f32_window": (64, 6, 2, 64, 512, 32, 16, 16, jnp.float32,
                        {"sliding_window": 128, "soft_cap": 30.0}),
    # --kv-cache-dtype fp8: a uint8 cache of fp8 bits with the k/v scales
    "llama8b_fp8_cache": (256, 32, 8, 128, 4096, 16, 64, 128, jnp.bfloat16,
                          {"kv_cache_dtype": "fp8", "k_scale": 1.0, "v_scale": 1.0}),
    # GPT-OSS: 64 q heads over 8 kv heads of 64, a 128-token window, attention sinks
    "gpt_oss_sinks": (128, 64, 8, 64, 1024, 16, 32, 64, jnp.bfloat16,
                      {"sliding_window": 128, "sinks": np.linspace(-1, 1, 64, dtype=np.float32)}),
}

TARGETS = [
    (name, platform)
    for name in kernels_pallas.list_backends()
    for platform in kernels_pallas.get_backend(name).platforms
    if platform != "cpu"
]


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("backend,platform", TARGETS, ids=[f"{b}-{p}" for b, p in TARGETS])
def test_attention_lowers(backend: str, platform: str, shape: str) -> None:
    t, hq, hkv, d, pages, p, seqs, pps, dtype, options = SHAPES[shape]
    args = [
        jax.ShapeDtypeStruct((t, hq, d), dtype),
        jax.ShapeDtypeStruct((pages, p, 2 * hkv, d), jnp.uint8 if "kv_cache_dtype" in options else dtype),
        jax.ShapeDtypeStruct((seqs,), jnp.int32),
        jax.ShapeDtypeStruct((seqs, pps), jnp.int32),
        jax.ShapeDtypeStruct((seqs + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    ]
    options = dict(options)
    sinks = options.pop("sinks", None)  # weights: an array argument, not part of the spec
    fn = functools.partial(kernels_pallas.ragged_paged_attention,
                           spec=kernels_pallas.AttentionSpec(sm_scale=d ** -0.5, **options),
                           sinks=sinks, backend=backend)
    exported = export.export(jax.jit(fn), platforms=[platform],
                             disabled_checks=DISABLED_CHECKS[platform])(*args)
    assert exported.out_avals[0].shape == (t, hq, d)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("backend,platform", TARGETS, ids=[f"{b}-{p}" for b, p in TARGETS])
def test_kv_write_lowers_in_place(backend: str, platform: str, kv_cache_dtype: str) -> None:
    kv = jax.ShapeDtypeStruct((4096, 16, 16, 128), jnp.bfloat16 if kv_cache_dtype == "auto" else jnp.uint8)
    k = jax.ShapeDtypeStruct((256, 8, 128), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((256,), jnp.int32)
    fn = functools.partial(kernels_pallas.update_kv_cache, backend=backend, kv_cache_dtype=kv_cache_dtype)
    exported = export.export(jax.jit(fn, donate_argnums=0), platforms=[platform],
                             disabled_checks=DISABLED_CHECKS[platform])(kv, k, k, slots)
    # The donated cache must alias the result, or every step would copy the whole cache.
    assert "tf.aliasing_output = 0" in exported.mlir_module()
