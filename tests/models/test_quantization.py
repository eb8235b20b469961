"""int8 weights: the quantizer's error bound, the int8 model equals a float model with the
dequantized weights (so the matmul dequantizes exactly), and it stays close to float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.arg_utils import make_engine_config
from jaxserve.models import LlamaForCausalLM
from jaxserve.models.llama import ModelOptions
from jaxserve.models.loaders import load_checkpoint
from jaxserve.models.quantization import (
    INT8_LAYERS, dequantize_int8, model_variables, param_bytes, param_tree, quantize_int8, quantize_params)
from jaxserve.parallel.sharding import param_shardings
from tests.models.forward import prompt_logits
from tests.models.tiny import save_tiny_hf


def test_quantize_int8_error_bound_and_layout() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 40, 24)).astype(np.float32)  # [L, in, out]
    w[1, :, 5] = 0.0  # an all-zero output channel (a padded head)
    q, s = quantize_int8(w, in_axis=-2, group_size=8)
    assert q.dtype == np.int8 and q.shape == (3, 24, 40) and s.shape == (3, 24, 5)
    assert np.abs(q).max() <= 127 and np.all(s > 0)
    back = dequantize_int8(q, s)
    err = np.abs(back - np.swapaxes(w, -1, -2))
    step = np.repeat(s, 8, axis=-1)  # each input's group scale
    assert np.all(err <= step / 2 + 1e-7)  # round to nearest: at most half a step
    assert np.all(back[1, 5] == 0)
    # Each group has its own scale: its largest magnitude maps to 127.
    group_max = np.abs(q.reshape(3, 24, 5, 8)).max(-1)
    group_max[1, 5] = 127  # the zero channel
    assert np.all(group_max == 127)
    # A group size that does not divide the inputs: one scale per output channel.
    assert quantize_int8(w, in_axis=-2, group_size=64)[1].shape == (3, 24, 1)
    # [out, in] input (embeddings) gives the same as its transpose as [in, out].
    q2, s2 = quantize_int8(np.swapaxes(w, -1, -2), in_axis=-1, group_size=8)
    assert np.array_equal(q, q2) and np.array_equal(s, s2)


def _dequantized_float_params(qparams: dict) -> dict:
    """The float tree whose weights are exactly the int8 ones dequantized."""

    def walk(node: dict) -> dict:
        out = {}
        for k, v in node.items():
            if isinstance(v, dict) and "qweight" in v:
                w = dequantize_int8(np.asarray(v["qweight"]), np.asarray(v["scale"]))
                rest = {kk: vv for kk, vv in v.items() if kk not in ("qweight", "scale")}
                out[k] = {**rest, "embedding": w} if k == "embed_tokens" else {**rest, "kernel": np.swapaxes(w, -1, -2)}
            elif isinstance(v, dict):
                out[k] = walk(v)
            else:
                out[k] = v
        return out

    return {"params": walk(qparams["params"])}


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": False}], ids=["tied", "lm_head"])
def test_int8_model_is_the_dequantized_float_model(overrides: dict, tmp_path) -> None:
    model_dir = save_tiny_hf("qwen2", str(tmp_path), **overrides)  # q/k/v biases stay float
    arch, params = load_checkpoint(model_dir, np.float32)
    qparams = quantize_params(params, "int8")
    leaves = jax.tree_util.tree_flatten_with_path(qparams)[0]
    kinds = {"/".join(str(p.key) for p in path[1:]): a.dtype for path, a in leaves}
    assert kinds["layers/self_attn/q_proj/qweight"] == np.int8
    assert kinds["layers/self_attn/q_proj/bias"] == np.float32
    assert kinds["embed_tokens/qweight"] == np.int8
    assert ("lm_head/qweight" in kinds) == (not arch.tie_word_embeddings)
    assert param_bytes(qparams) < 0.4 * param_bytes(params)

    qmodel, fmodel = LlamaForCausalLM(arch, ModelOptions(quantization="int8")), LlamaForCausalLM(arch)
    dparams = _dequantized_float_params(qparams)
    # 20 tokens take the CPU int8 kernel, 57 XLA's matmul (CPU_KERNEL_MAX_TOKENS = 32).
    short_ids = list(range(3, 23))
    q_short, d_short = prompt_logits(qmodel, qparams, short_ids), prompt_logits(fmodel, dparams, short_ids)
    assert np.abs(q_short - d_short).max() < 1e-4 * np.abs(d_short).max()
    ids = list(range(3, 60))
    q = prompt_logits(qmodel, qparams, ids)
    d = prompt_logits(fmodel, dparams, ids)
    f = prompt_logits(fmodel, params, ids)
    assert np.abs(q - d).max() < 1e-4 * np.abs(d).max()
    # int8 moves the logits by a fraction of their spread, not more.
    assert np.abs(q - f).max() < 0.05 * np.abs(f).max()


def test_layer_int8_weights_move_to_their_collection_and_back(tmp_path) -> None:
    # The layer scan takes int8 weights whole (INT8_LAYERS, broadcast) and indexes them itself.
    model_dir = save_tiny_hf("qwen2", str(tmp_path), tie_word_embeddings=False)
    arch, params = load_checkpoint(model_dir, np.float32)
    qparams = quantize_params(params, "int8")
    variables = model_variables(qparams)
    moved = variables[INT8_LAYERS]["layers"]
    assert set(moved["self_attn"]["q_proj"]) == {"qweight", "scale"}
    assert moved["self_attn"]["q_proj"]["qweight"].shape[0] == arch.num_hidden_layers
    layers = variables["params"]["layers"]
    assert set(layers["self_attn"]["q_proj"]) == {"bias"} and "o_proj" not in layers["self_attn"]
    assert "scale" in layers["input_layernorm"]  # a norm's scale is not an int8 scale
    assert "qweight" in variables["params"]["lm_head"]  # outside the scan: stays
    back = param_tree(variables)
    assert jax.tree.structure(back) == jax.tree.structure(qparams)
    assert all(a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(qparams)))
    assert model_variables(params) is params  # float: nothing moves
    # model.init declares the same split, and param_tree gives the loaders' layout.
    ids = jnp.zeros((4,), jnp.int32)
    from jaxserve.models import AttentionMetadata
    md = AttentionMetadata(ids, ids[:1], jnp.zeros((1, 2), jnp.int32), jnp.zeros((2,), jnp.int32), ids[:1])
    model = LlamaForCausalLM(arch, ModelOptions(quantization="int8"))
    init = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids, jnp.zeros(LlamaForCausalLM(arch).kv_cache(3, 16).shape), md))
    assert INT8_LAYERS in init
    shapes = lambda t: jax.tree.map(lambda a: (tuple(a.shape), jnp.dtype(a.dtype)), t)  # noqa: E731
    # init has no LM head here (only __call__ ran), the loaders' tree has one.
    loaded = {**qparams, "params": {k: v for k, v in qparams["params"].items() if k != "lm_head"}}
    assert shapes(param_tree(init)) == shapes(loaded)


def test_every_int8_leaf_has_a_sharding_rule(tmp_path) -> None:
    from jax.sharding import Mesh

    model_dir = save_tiny_hf("qwen3", str(tmp_path), tie_word_embeddings=False)
    _, params = load_checkpoint(model_dir, np.float32)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "stage", "model"))
    shardings = param_shardings(quantize_params(params, "int8"), mesh)  # raises on a missing rule
    assert len(jax.tree.leaves(shardings)) == len(jax.tree.leaves(quantize_params(params, "int8")))


def test_bad_quantization_names_the_field() -> None:
    with pytest.raises(ValueError, match="quantization must be one of int8"):
        ModelConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization"):
        make_engine_config(quantization="fp4")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_fp8_kv_cache_stays_near_the_float32_cache(backend: str, tmp_path) -> None:
    model_dir = save_tiny_hf("llama", str(tmp_path))
    arch, params = load_checkpoint(model_dir, np.float32)
    ids = list(range(3, 60))
    f = prompt_logits(LlamaForCausalLM(arch, ModelOptions(attention_backend=backend)), params, ids)
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        model = LlamaForCausalLM(arch, ModelOptions(attention_backend=backend, kv_cache_dtype=kv))
        q = prompt_logits(model, params, ids)  # a uint8 cache holding fp8 bits
        assert np.isfinite(q).all()
        assert 0 < np.abs(q - f).max() < 0.05 * np.abs(f).max()


def test_bad_kv_cache_dtype_names_the_field() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        make_engine_config(kv_cache_dtype="int4")


def test_cpu_int8_kernel_only_without_tensor_parallelism(tmp_path) -> None:
    # The kernel has no sharding rule: a tensor-parallel model (mesh set) keeps XLA's matmul.
    from jax.sharding import Mesh

    from jaxserve.models import AttentionMetadata
    from kernels_pallas.int8_matmul import cpu

    model_dir = save_tiny_hf("llama", str(tmp_path))
    arch, params = load_checkpoint(model_dir, np.float32)
    variables = model_variables(quantize_params(params, "int8"))
    ids = jnp.zeros((4,), jnp.int32)
    md = AttentionMetadata(ids, jnp.array([4], jnp.int32), jnp.zeros((1, 2), jnp.int32),
                           jnp.array([0, 4], jnp.int32), jnp.array([1], jnp.int32))
    cache = jnp.zeros(LlamaForCausalLM(arch).kv_cache(3, 16).shape)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "stage", "model"))
    for m, uses_kernel in ((None, True), (mesh, False)):
        model = LlamaForCausalLM(arch, ModelOptions(quantization="int8", mesh=m))
        hlo = jax.jit(lambda v: model.apply(v, ids, ids, cache, md)).lower(variables).as_text()
        assert (cpu.TARGET in hlo) == uses_kernel
