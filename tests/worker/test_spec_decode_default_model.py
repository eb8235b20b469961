"""N-gram speculative decoding end to end on the default model: greedy output identical
with and without it (mixed with requests that get no drafts, under chunked prefill), and
seeded sampling keeping its distribution (a two-sample test over many seeds)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "Sphinx of black quartz, judge my vow.")
PROMPTS = [
    f"Repeat this text exactly:\n\n{TEXT}\n\n{TEXT}\n\n",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
    "The capital of France is",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,",
]
# Each compiles the programs its steps use (no warm-up of every bucket: CI's time).
COMMON = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64,
              kv_cache_memory_bytes=128 << 20, enforce_eager=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    plain = LLM(**COMMON)
    spec = LLM(**COMMON, speculative_config=SPEC)
    # Draft in every step (DraftPolicy, tested on its own, would drop drafts where this
    # CPU is compute-bound): these tests are about verification.
    spec.engine_core.scheduler.drafter.policy.pays = lambda *_: True
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


def test_greedy_output_is_identical_with_speculation(engines) -> None:
    plain, spec = engines
    greedy = SamplingParams(temperature=0.0, max_tokens=48)
    params = [greedy] * len(PROMPTS) + [
        # No drafts for these (penalties, logprobs): they share verification steps.
        SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["lazy dog"], min_tokens=3),
    ]
    prompts = PROMPTS + PROMPTS[:3]
    want = plain.generate(prompts, params, use_tqdm=False)
    spec.engine_core.scheduler.make_stats()
    got = spec.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    lp_want, lp_got = want[-2].outputs[0].logprobs, got[-2].outputs[0].logprobs
    assert [sorted(d) for d in lp_got] == [sorted(d) for d in lp_want]
    st = spec.engine_core.scheduler.make_stats().spec_decoding_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > st.num_drafts  # > 1 token a draft
    # The counting prompt: fewer decode steps than tokens (several tokens per forward).
    summary = got[2].metrics.trace.summary()
    decode_steps = summary["num_steps"] - summary["prefill_steps"]
    assert decode_steps < 0.6 * summary["output_tokens"], summary


def test_seeded_sampling_keeps_its_distribution(engines) -> None:
    plain, spec = engines
    n, k = 240, 6
    prompt = PROMPTS[2]
    params = [SamplingParams(temperature=1.0, max_tokens=k, seed=s, ignore_eos=True)
              for s in range(n)]
    spec.engine_core.scheduler.make_stats()
    samples = {name: [o.outputs[0].token_ids for o in llm.generate([prompt] * n, params,
                                                                    use_tqdm=False)]
               for name, llm in (("plain", plain), ("spec", spec))}
    st = spec.engine_core.scheduler.make_stats().spec_decoding_stats
    assert st.num_accepted_tokens > 0 and st.num_draft_tokens > st.num_accepted_tokens
    # Seeded: the same seed gives the same tokens again, with speculation too.
    again = spec.generate([prompt] * 8, params[:8], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == samples["spec"][:8]
    # Each position's token distribution, plain against speculative: a chi-square test of
    # homogeneity over the tokens seen (rare ones pooled).
    for pos in range(k):
        a = [t[pos] for t in samples["plain"]]
        b = [t[pos] for t in samples["spec"]]
        vocab = sorted(set(a) | set(b))
        table = np.array([[a.count(v) for v in vocab], [b.count(v) for v in vocab]])
        common = table.sum(axis=0) >= 10
        table = np.column_stack([table[:, common], table[:, ~common].sum(axis=1)])
        table = table[:, table.sum(axis=0) > 0]
        if table.shape[1] < 2:
            continue  # one token only: nothing to compare
        p = stats.chi2_contingency(table).pvalue
        assert p > 1e-3, (pos, table)
