"""int8 weights: the quantizer's error bound, the int8 model equals a float model with the
dequantized weights (so the matmul dequantizes exactly), and it stays close to float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import KVCacheDtype, ModelConfig, WeightFormat
from jaxserve.engine.arg_utils import make_engine_config
from jaxserve.models import LlamaForCausalLM
from jaxserve.models.attention import ModelOptions
from jaxserve.models.loaders import load_checkpoint
from jaxserve.models.quantization import dequantize_int8, pack_params, param_bytes, quantize_int8, quantize_params
from jaxserve.models.variables import INT8_LAYERS, model_variables, param_tree
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
    qparams = quantize_params(params, WeightFormat.INT8)
    leaves = jax.tree_util.tree_flatten_with_path(qparams)[0]
    kinds = {"/".join(str(p.key) for p in path[1:]): a.dtype for path, a in leaves}
    assert kinds["layers/self_attn/q_proj/qweight"] == np.int8
    assert kinds["layers/self_attn/q_proj/bias"] == np.float32
    assert kinds["embed_tokens/qweight"] == np.int8
    assert ("lm_head/qweight" in kinds) == (not arch.tie_word_embeddings)
    assert param_bytes(qparams) < 0.4 * param_bytes(params)

    qmodel, fmodel = LlamaForCausalLM(arch, ModelOptions(weight_format=WeightFormat.INT8)), LlamaForCausalLM(arch)
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
    qparams = quantize_params(params, WeightFormat.INT8)
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
    md = AttentionMetadata(ids[None], ids[:1], jnp.zeros((1, 1, 2), jnp.int32), jnp.zeros((2,), jnp.int32), ids[:1])
    model = LlamaForCausalLM(arch, ModelOptions(weight_format=WeightFormat.INT8))
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
    shardings = param_shardings(quantize_params(params, WeightFormat.INT8), mesh)  # raises on a missing rule
    assert len(jax.tree.leaves(shardings)) == len(jax.tree.leaves(quantize_params(params, WeightFormat.INT8)))


def test_bad_quantization_names_the_field() -> None:
    with pytest.raises(ValueError, match="quantization must be one of int8"):
        ModelConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization"):
        make_engine_config(quantization="fp4")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_fp8_and_bf16_kv_caches_stay_near_the_float32_cache(backend: str, tmp_path) -> None:
    model_dir = save_tiny_hf("llama", str(tmp_path))
    arch, params = load_checkpoint(model_dir, np.float32)
    ids = list(range(3, 60))
    f = prompt_logits(LlamaForCausalLM(arch, ModelOptions(attention_backend=backend)), params, ids)
    for kv in (KVCacheDtype.FP8_E4M3, KVCacheDtype.FP8_E5M2, KVCacheDtype.BFLOAT16):
        model = LlamaForCausalLM(arch, ModelOptions(attention_backend=backend, kv_cache_dtype=kv))
        q = prompt_logits(model, params, ids)  # a uint8 (uint16) cache holding fp8 (bf16) bits
        assert np.isfinite(q).all()
        assert 0 < np.abs(q - f).max() < 0.05 * np.abs(f).max()


def test_bad_kv_cache_dtype_names_the_field() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, fp8"):
        make_engine_config(kv_cache_dtype="int4")


def test_cpu_int8_kernel_only_without_tensor_parallelism(tmp_path) -> None:
    # The kernel has no sharding rule: a tensor-parallel model (mesh set) keeps XLA's matmul.
    from jax.sharding import Mesh

    from jaxserve.models import AttentionMetadata
    from kernels_pallas.int8_matmul import cpu

    model_dir = save_tiny_hf("llama", str(tmp_path))
    arch, params = load_checkpoint(model_dir, np.float32)
    variables = model_variables(quantize_params(params, WeightFormat.INT8))
    ids = jnp.zeros((4,), jnp.int32)
    md = AttentionMetadata(ids[None], jnp.array([4], jnp.int32), jnp.zeros((1, 1, 2), jnp.int32),
                           jnp.array([0, 4], jnp.int32), jnp.array([1], jnp.int32))
    cache = jnp.zeros(LlamaForCausalLM(arch).kv_cache(3, 16).shape)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "stage", "model"))
    for m, uses_kernel in ((None, True), (mesh, False)):
        model = LlamaForCausalLM(arch, ModelOptions(weight_format=WeightFormat.INT8, mesh=m))
        hlo = jax.jit(lambda v: model.apply(v, ids, ids, cache, md)).lower(variables).as_text()
        assert (cpu.TARGET in hlo) == uses_kernel


def _bf16_rounded(params: dict) -> dict:
    """The float32 tree with every projection and the embedding rounded to bf16 (what
    `quantize_params(params, WeightFormat.BF16)` holds, in float32 and Flax's layout)."""
    def walk(node):
        if not isinstance(node, dict):
            return node
        return {k: (np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32))
                    if k in ("kernel", "embedding") else walk(v)) for k, v in node.items()}
    return {"params": walk(params["params"])}


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": False}], ids=["tied", "lm_head"])
def test_bf16_model_is_the_float_model_with_bf16_rounded_weights(overrides: dict, tmp_path) -> None:
    from kernels_pallas.bf16_matmul import cpu

    model_dir = save_tiny_hf("qwen2", str(tmp_path), **overrides)  # q/k/v biases stay float
    arch, params = load_checkpoint(model_dir, np.float32)
    bparams = quantize_params(params, WeightFormat.BF16)
    _, direct = load_checkpoint(model_dir, np.float32, WeightFormat.BF16)  # one tensor at a time
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), direct, bparams))
    kinds = {"/".join(str(p.key) for p in path[1:]): a for path, a in jax.tree_util.tree_flatten_with_path(bparams)[0]}
    assert kinds["layers/self_attn/q_proj/qweight"].dtype == jnp.bfloat16
    assert kinds["layers/self_attn/q_proj/qweight"].shape == (arch.num_hidden_layers, arch.q_size, arch.hidden_size)
    assert kinds["layers/self_attn/q_proj/bias"].dtype == np.float32
    assert "layers/self_attn/q_proj/scale" not in kinds
    assert ("lm_head/qweight" in kinds) == (not arch.tie_word_embeddings)
    assert 0.45 * param_bytes(params) < param_bytes(bparams) < 0.55 * param_bytes(params)

    bmodel, fmodel = LlamaForCausalLM(arch, ModelOptions(weight_format=WeightFormat.BF16)), LlamaForCausalLM(arch)
    rparams = _bf16_rounded(params)
    # 12 tokens take the few-token kernel: float32 products of the same bf16 weights.
    short_ids = list(range(3, 15))
    b_short, r_short = prompt_logits(bmodel, bparams, short_ids), prompt_logits(fmodel, rparams, short_ids)
    assert np.abs(b_short - r_short).max() < 1e-4 * np.abs(r_short).max()
    # 57 tokens take oneDNN (activations rounded to bf16 too) or XLA's matmul.
    ids = list(range(3, 60))
    b, r, f = (prompt_logits(bmodel, bparams, ids), prompt_logits(fmodel, rparams, ids),
               prompt_logits(fmodel, params, ids))
    assert np.abs(b - r).max() < (2e-2 if cpu.onednn_available() else 1e-4) * np.abs(r).max()
    assert np.abs(b - f).max() < 0.05 * np.abs(f).max()


@pytest.mark.parametrize("packed", ["1", "0"], ids=["packed", "plain"])
def test_bf16_weights_through_the_engine_match_float32_greedy(packed: str, tmp_path) -> None:
    from jaxserve import LLM, SamplingParams
    from kernels_pallas.bf16_matmul import packing_available

    packed_here = packed == "1" and packing_available()
    model_dir = save_tiny_hf("llama", str(tmp_path))
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40)]
    sp = SamplingParams(temperature=0, max_tokens=8)
    tokens = {}
    for q in (None, "bf16"):
        # A 40-token prefill and decodes of 1-2 tokens: oneDNN on packed weights for both, or
        # oneDNN (where it is available) for the prefill and the few-token kernel for decodes.
        llm = LLM(model_dir, quantization=q, max_model_len=128, max_num_seqs=4, skip_tokenizer_init=True,
                  max_num_batched_tokens=64, kv_cache_memory_bytes=4 << 20, enforce_eager=True,
                  cpu_packed_weights=packed == "1")
        if q:
            worker = llm.engine.worker
            assert worker.weight_format.packed == packed_here
            down = worker.stages[0].params["params"]["layers"]["mlp"]["down_proj"]
            if packed_here:
                assert worker.weight_matmul.startswith("weights packed at load in oneDNN's layout")
                assert set(down) == {"packed"} and down["packed"].ndim == 2  # [layers, S]
            else:
                assert worker.weight_matmul.startswith("CPU kernel up to 16 tokens a step")
                assert down["qweight"].dtype == jnp.bfloat16 and down["qweight"].ndim == 3  # [layers, out, in]
        tokens[q] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        llm.shutdown()
    assert tokens["bf16"] == tokens[None]


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": False}], ids=["tied", "lm_head"])
def test_packed_bf16_model_is_the_onednn_bf16_model(overrides: dict, tmp_path) -> None:
    from jax.sharding import Mesh

    from jaxserve.parallel.pipeline import abstract_params
    from kernels_pallas.bf16_matmul import packing_available

    if not packing_available():
        pytest.skip("no native oneDNN bf16 matmul here: nothing is packed")
    model_dir = save_tiny_hf("qwen2", str(tmp_path), **overrides)
    arch, params = load_checkpoint(model_dir, np.float32, WeightFormat.BF16)
    pparams = pack_params(params, arch.tie_word_embeddings)
    kinds = {"/".join(str(p.key) for p in path[1:]): a for path, a in jax.tree_util.tree_flatten_with_path(pparams)[0]}
    assert "layers/self_attn/q_proj/qweight" not in kinds
    assert kinds["layers/self_attn/q_proj/packed"].shape[0] == arch.num_hidden_layers
    assert kinds["layers/self_attn/q_proj/bias"].dtype == np.float32
    assert "embed_tokens/qweight" in kinds  # the lookup's rows stay
    assert ("embed_tokens/packed" in kinds) == arch.tie_word_embeddings
    assert ("lm_head/packed" in kinds) == (not arch.tie_word_embeddings)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "stage", "model"))
    param_shardings(pparams, mesh)  # every packed leaf has a rule

    pmodel = LlamaForCausalLM(arch, ModelOptions(weight_format=WeightFormat.BF16_PACKED))
    # The model declares the packed shapes (--load-format dummy and sizing build from these).
    shape = lambda t: jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), t)  # noqa: E731
    assert shape(abstract_params(pmodel)) == shape(pparams)
    bmodel = LlamaForCausalLM(arch, ModelOptions(weight_format=WeightFormat.BF16))
    # 57 tokens: the plain model runs oneDNN too (repacking per call); the same products.
    ids = list(range(3, 60))
    p, b = prompt_logits(pmodel, pparams, ids), prompt_logits(bmodel, params, ids)
    assert np.abs(p - b).max() < 1e-4 * np.abs(b).max()
    # 12 tokens: the plain model's few-token kernel keeps float32 activations; packed rounds them.
    short = list(range(3, 15))
    p, b = prompt_logits(pmodel, pparams, short), prompt_logits(bmodel, params, short)
    assert np.abs(p - b).max() < 2e-2 * np.abs(b).max()


def test_bf16_refuses_experts_by_name(tmp_path) -> None:
    model_dir = save_tiny_hf("qwen3_moe", str(tmp_path))
    with pytest.raises(ValueError, match="quantization 'bf16' does not cover mixture-of-experts"):
        load_checkpoint(model_dir, np.float32, WeightFormat.BF16)
    arch, params = load_checkpoint(model_dir, np.float32)
    with pytest.raises(ValueError, match="quantization 'bf16'"):
        quantize_params(params, WeightFormat.BF16)


def test_a_checkpoint_stored_quantized_is_refused_by_name(tmp_path) -> None:
    """GPTQ, AWQ, bitsandbytes and compressed-tensors configurations jaxserve does not read
    (models/checkpoint_quant.py reads the rest) are refused before any tensor is read, naming
    the scheme or field, offline (ValueError) and at the command line (a usage error, before
    any process starts)."""
    import json
    import subprocess
    import sys

    from jaxserve.models.loaders import read_arch

    model_dir = save_tiny_hf("llama", str(tmp_path))
    cases = [
        ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"]},
         "config_groups: missing"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {
            "format": "marlin-24", "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
         "config_groups.g.format 'marlin-24' is not supported"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size: None"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "load_in_4bit=True"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128, "desc_act": False}, "bits: 3"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv_fast"}, "version: 'gemv_fast'"),
    ]
    path = f"{model_dir}/config.json"
    config = json.load(open(path))
    for qc, named in cases:
        json.dump({**config, "quantization_config": qc}, open(path, "w"))
        for load in (read_arch, lambda d: load_checkpoint(d, np.float32)):
            with pytest.raises(ValueError, match="quantization_config") as e:
                load(model_dir)
            assert named in str(e.value), str(e.value)
    proc = subprocess.run([sys.executable, "-m", "jaxserve.serve", "--model", model_dir],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "quantization_config" in proc.stderr, proc.stderr[-2000:]
    assert "'gemv_fast'" in proc.stderr and "Traceback" not in proc.stderr
