"""The Gated DeltaNet hybrids (Qwen3.5 dense and MoE, Qwen3-Next: experts with a shared one
and a dense layer among them) against transformers, float32, on tiny random checkpoints: every
position's logits over a whole prompt, the same prompt in several steps carrying its states
through slots (a prefix-cache hit's read slot apart from its write slot too), two sequences
side by side; Qwen3-Next through the engine (chunks, preemption, prefix hits on kept states,
prompt logprobs); and the start-up errors for a bad config, checkpoint or flag."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.attention import ModelOptions
from jaxserve.models.attention_metadata import AttentionMetadata, StateMetadata
from jaxserve.models.loaders import load_checkpoint
from jaxserve.models.loaders.weights import WeightLoadError
from jaxserve.models.qwen3_next import HybridCache, Qwen3NextForCausalLM, hybrid_kv_cache_groups
from tests.models.tiny import hf_logits, save_tiny_hf

PAGE = 4
PROMPT = [(7 * i) % 120 + 3 for i in range(37)]  # 10 pages: the delta rule token by token
LONG = [(13 * i) % 125 + 2 for i in range(150)]  # its chunked form: two chunks of 64 and a short one
PAGES = 48  # per sequence
SECOND = [(11 * i) % 97 + 5 for i in range(13)]


def _tiny(kind: str, tmp_path_factory) -> str:
    return save_tiny_hf(kind, str(tmp_path_factory.mktemp(kind)), initializer_range=0.2,
                        tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def hybrid(request, tmp_path_factory) -> tuple[str, ArchConfig, Qwen3NextForCausalLM, dict]:
    path = _tiny(request.param, tmp_path_factory)
    arch, params = load_checkpoint(path, np.float32)
    model = Qwen3NextForCausalLM(arch, ModelOptions(kv_cache_groups=hybrid_kv_cache_groups(arch)))
    return path, arch, model, jax.tree.map(jnp.asarray, params)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory) -> str:
    return _tiny("qwen3_5", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> str:
    """One hybrid through the engine, the form with the most parts (CI's time)."""
    return _tiny("qwen3_next", tmp_path_factory)


class Steps:
    """Runs steps of a ragged batch through the hybrid decoder over one cache: each sequence
    its own pages (sequence s: pages 1 + s * PAGES ...) and the state slots a step names."""

    def __init__(self, model: Qwen3NextForCausalLM, params: dict, num_seqs: int,
                 num_state_slots: int = 8) -> None:
        self.model, self.params, self.max_seqs = model, params, num_seqs
        spec = model.kv_cache(1 + PAGES * num_seqs, PAGE, num_state_slots)
        self.cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec)
        self.run = jax.jit(self._run)

    def _run(self, params: dict, ids: jax.Array, pos: jax.Array, cache: HybridCache,
             md: AttentionMetadata) -> tuple[jax.Array, HybridCache]:
        h, cache = self.model.apply(params, ids, pos, cache, md)
        return self.model.apply(params, h, method=Qwen3NextForCausalLM.compute_logits), cache

    def step(self, chunks: list[tuple[list[int], int, int, int]]) -> list[np.ndarray]:
        """`chunks`: per sequence (its tokens this step, tokens computed before, read slot,
        write slot). Returns each sequence's logits for its tokens."""
        ids, pos, slots, cu, kv_lens = [], [], [], [0], []
        pages = np.zeros((2, self.max_seqs, PAGES), np.int32)
        for s, (tokens, start, _, _) in enumerate(chunks):
            pages[0, s] = 1 + PAGES * s + np.arange(PAGES)
            p = np.arange(start, start + len(tokens))
            ids += tokens
            pos += p.tolist()
            slots += (pages[0, s, p // PAGE] * PAGE + p % PAGE).tolist()
            cu.append(cu[-1] + len(tokens))
            kv_lens.append(start + len(tokens))
        n = len(chunks)
        pad = lambda x, k, v=0: x + [v] * (k - len(x))  # noqa: E731
        state = StateMetadata(
            read_slots=jnp.asarray(pad([c[2] for c in chunks], self.max_seqs), jnp.int32),
            write_slots=jnp.asarray(pad([c[3] for c in chunks], self.max_seqs), jnp.int32),
            has_initial_state=jnp.asarray(pad([c[1] > 0 for c in chunks], self.max_seqs, False)))
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(np.stack([slots, np.zeros(len(slots), int)]), jnp.int32),
            kv_lens=jnp.asarray(pad(kv_lens, self.max_seqs), jnp.int32),
            page_indices=jnp.asarray(pages),
            cu_q_lens=jnp.asarray(pad(cu, self.max_seqs + 1, cu[-1]), jnp.int32),
            num_seqs=jnp.asarray([n], jnp.int32), state=state)
        logits, self.cache = self.run(self.params, jnp.asarray(ids, jnp.int32),
                                      jnp.asarray(pos, jnp.int32), self.cache, md)
        logits = np.asarray(logits)
        return [logits[cu[s]:cu[s + 1]] for s in range(n)]


@pytest.mark.parametrize("prompt", [PROMPT, LONG], ids=["recurrent", "chunked"])
def test_whole_prompt_logits_equal_transformers(hybrid, prompt: list[int]) -> None:
    path, arch, model, params = hybrid
    assert arch.linear_layers == (0, 1, 2) and arch.attention_layers == (3,)
    want = hf_logits(path, prompt)
    got = Steps(model, params, 1).step([(prompt, 0, 1, 1)])[0]
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)


def test_a_prompt_in_steps_and_a_state_kept_for_a_prefix_hit(hybrid) -> None:
    """Chunks of 12, 12 and 13 tokens then a decode step carry the states through slot 1;
    a second sequence starting from a copy of the state after 24 tokens (read slot 2, written
    to slot 3, as a prefix hit) computes the same last 13 tokens, beside it in one step."""
    path, arch, model, params = hybrid
    want = hf_logits(path, PROMPT + [5])
    run = Steps(model, params, 2)
    out = [run.step([(PROMPT[:12], 0, 1, 1)])[0], run.step([(PROMPT[12:24], 12, 1, 1)])[0]]
    # Keep the state after 24 tokens: a copy in slot 2 (what a stored boundary holds).
    run.cache = HybridCache(run.cache.kv, run.cache.conv.at[:, 2].set(run.cache.conv[:, 1]),
                            run.cache.ssm.at[:, 2].set(run.cache.ssm[:, 1]))
    # The second sequence reuses the first's pages for its prefix: same page table, same KV.
    run.cache = HybridCache(run.cache.kv.at[:, 1 + PAGES:7 + PAGES].set(run.cache.kv[:, 1:7]),
                            run.cache.conv, run.cache.ssm)
    first, second = run.step([(PROMPT[24:], 24, 1, 1), (PROMPT[24:], 24, 2, 3)])
    out += [first, run.step([([5], 37, 1, 1)])[0]]
    np.testing.assert_allclose(np.concatenate(out), want, atol=2e-3, rtol=0)
    np.testing.assert_allclose(second, first, atol=1e-5, rtol=0)
    # The kept state was read, not written: slot 2 still holds the state after 24 tokens.
    assert not np.allclose(np.asarray(run.cache.ssm[:, 2]), np.asarray(run.cache.ssm[:, 3]))


def test_two_sequences_side_by_side_equal_each_alone(hybrid) -> None:
    path, arch, model, params = hybrid
    alone = [Steps(model, params, 1).step([(p, 0, 1, 1)])[0] for p in (PROMPT, SECOND)]
    both = Steps(model, params, 2).step([(PROMPT, 0, 1, 1), (SECOND, 0, 2, 2)])
    # The experts' grouped matmul blocks the batch's tokens by expert: another batch sums in
    # another order (2e-5 apart seen).
    tol = 1e-4 if arch.num_experts else 1e-5
    for a, b in zip(alone, both):
        np.testing.assert_allclose(b, a, atol=tol, rtol=0)


def test_qwen3_5_moe_and_fused_expert_stacks(tmp_path) -> None:
    """Qwen3.5-MoE (every layer's experts and a shared one, the router always renormalizing)
    equals transformers; its experts stored as transformers' fused stacks (gate_up_proj
    [E, 2I, H], down_proj [E, H, I]) load as the per-expert tensors do."""
    from safetensors.numpy import load_file, save_file

    path = save_tiny_hf("qwen3_5_moe", str(tmp_path), initializer_range=0.2,
                        tie_word_embeddings=False)
    arch, params = load_checkpoint(path, np.float32)
    assert arch.num_experts == 4 and arch.moe_layers is None and arch.norm_topk_prob
    model = Qwen3NextForCausalLM(arch, ModelOptions(kv_cache_groups=hybrid_kv_cache_groups(arch)))
    got = Steps(model, jax.tree.map(jnp.asarray, params), 1).step([(PROMPT, 0, 1, 1)])[0]
    np.testing.assert_allclose(got, hf_logits(path, PROMPT), atol=2e-3, rtol=0)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        take = lambda n: np.stack([tensors.pop(f"{p}.{e}.{n}.weight") for e in range(4)])  # noqa: E731
        gate, up, down = take("gate_proj"), take("up_proj"), take("down_proj")
        tensors[f"{p}.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        tensors[f"{p}.down_proj"] = down
    save_file(tensors, file)
    _, fused = load_checkpoint(path, np.float32)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(fused), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_text_decoder_of_qwen3_5s_image_and_text_checkpoint(tmp_path) -> None:
    """Qwen3_5ForConditionalGeneration as published (config.json's text_config, the decoder's
    weights under model.language_model, a vision tower beside): its text decoder is served,
    logits equal to transformers' on a text-only prompt (no image tokens: mrope's three
    position streams are one)."""
    import torch
    import transformers

    torch.manual_seed(0)
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_conv_kernel_dim=4, initializer_range=0.2,
                tie_word_embeddings=False)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64)
    hf = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=False)).eval()
    path = str(tmp_path / "qwen3_5_vl")
    hf.save_pretrained(path)
    arch, params = load_checkpoint(path, np.float32)
    assert arch.architecture == "Qwen3_5ForCausalLM" and arch.linear_layers == (0, 1, 2)
    model = Qwen3NextForCausalLM(arch, ModelOptions(kv_cache_groups=hybrid_kv_cache_groups(arch)))
    got = Steps(model, jax.tree.map(jnp.asarray, params), 1).step([(PROMPT, 0, 1, 1)])[0]
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)


def _edit_config(path: str, **changes) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("changes,match", [
    ({"layer_types": ["linear_attention"] * 3}, r"layer_types must list 4 layers"),
    ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]},
     r"each one of linear_attention, full_attention"),
    ({"linear_num_value_heads": 3}, r"linear_num_value_heads \(3\) must be a multiple of "
                                    r"linear_num_key_heads \(2\)"),
])
def test_a_bad_config_is_refused_naming_the_field(tmp_path, changes: dict, match: str) -> None:
    path = save_tiny_hf("qwen3_5", str(tmp_path))
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=match):
        load_checkpoint(path, np.float32)


def test_a_missing_or_misshapen_tensor_is_refused_naming_it(tmp_path) -> None:
    from safetensors.numpy import load_file, save_file

    path = save_tiny_hf("qwen3_5", str(tmp_path))
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.linear_attn.in_proj_z.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, file)
    with pytest.raises(WeightLoadError, match=f"tensor '{name}' is missing"):
        load_checkpoint(path, np.float32)
    save_file({**tensors, name: tensors[name][:-1]}, file)
    with pytest.raises(WeightLoadError, match=f"tensor '{name}' has shape \\(31, 64\\), "
                                              r"expected \(32, 64\)"):
        load_checkpoint(path, np.float32)


PROMPTS = [PROMPT[:30], [3], SECOND * 2]
ENGINE = dict(skip_tokenizer_init=True, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16,
              block_size=4, enforce_eager=True, mamba_block_size=8)


def test_through_the_engine_with_chunks_preemption_and_prefix_hits(qwen3_next: str) -> None:
    """Greedy tokens equal transformers' with 16-token chunks and too few pages for the three
    at once (preemption frees a request's state slots; resumption recomputes), then again
    with prefix hits that land only on the kept states' boundaries (every 8 tokens); prompt
    logprobs within 2e-3 of transformers'."""
    import torch
    import transformers

    from jaxserve import LLM, SamplingParams
    from tests.models.tiny import hf_greedy

    path = qwen3_next
    want = hf_greedy(path, PROMPTS, 16)
    # 25 pages of 4 tokens: one 96-token request and the null page; the three need 31.
    llm = LLM(path, num_gpu_blocks_override=25, **ENGINE)
    assert llm.engine_core.worker.num_state_slots == 1 + 4 * 2 * 2
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == want
    assert llm.engine_core.scheduler.total_num_preemptions > 0
    # /debug's kv_cache_manager box: the state pool's share apart from the pages'.
    assert set(llm.engine_core.scheduler.kv_cache_manager.usage_by_kind()) == {
        "full_attention", "recurrent_state"}
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want
    hits = [o.num_cached_tokens for o in again]
    assert hits[0] > 0 and hits[2] > 0 and all(h % 8 == 0 for h in hits), hits
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0], -1).numpy()
    for p in range(1, len(PROMPT)):
        for tok, lp in out.prompt_logprobs[p].items():
            assert abs(lp.logprob - ref[p - 1, tok]) <= 2e-3, (p, tok, lp, ref[p - 1, tok])
    llm.shutdown()


@pytest.mark.parametrize("flags,match", [
    (dict(tensor_parallel_size=2), r"--tensor-parallel-size .* not supported for the Gated"),
    (dict(quantization="int8"), r"int8 weights are not supported for the Gated DeltaNet"),
    (dict(mamba_cache_mode="all"), r"--mamba-cache-mode all .* is not supported"),
    (dict(mamba_block_size=6, block_size=4), r"--mamba-block-size 6 must be a multiple of "
                                             r"--block-size 4"),
    (dict(mamba_cache_mode="align", enable_prefix_caching=False), r"needs --enable-prefix-caching"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     r"--speculative-config is not supported for the Gated DeltaNet hybrids yet"),
])
def test_what_they_do_not_run_with_is_refused_naming_the_flag(qwen3_5: str, flags: dict,
                                                             match: str) -> None:
    from jaxserve.engine.arg_utils import EngineArgs
    from jaxserve.engine.resolve import resolve_engine_config

    with pytest.raises(ValueError, match=match):
        resolve_engine_config(EngineArgs(model=qwen3_5, **flags).create_engine_config())
