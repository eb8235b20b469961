"""LLM.generate with the real default model, float32, against transformers' greedy decoding,
and the same tokens under chunked prefill, preemption, prefix caching on/off and batching."""

from __future__ import annotations

import gc
import json
import re
import weakref

import jax
import pytest

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "def add(a, b):",
    "The quick brown fox",
    "In 1492, Columbus",
    "Water boils at",
    "My favourite programming language is Python because it is easy to read, has a huge "
    "ecosystem of libraries and a friendly community that",
    "Q: What is the largest planet in the solar system?\nA:",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books about",
    "1, 2, 3, 4,",
    "The recipe for pancakes needs flour, eggs, milk and",
    "To be or not to be,",
    "Translate to French: I love cheese. ->",
    "The three primary colours are",
    "A haiku about autumn leaves:\n",
    "Photosynthesis is the process by which plants convert sunlight, water and carbon dioxide "
    "into glucose and oxygen. It happens in the chloroplasts, which contain",
]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
COMMON = dict(max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=256 << 20)


def hf_greedy(model, token_ids: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model(torch.tensor([token_ids]), use_cache=True)
        past, nxt, result = out.past_key_values, int(out.logits[0, -1].argmax()), []
        for _ in range(n):
            result.append(nxt)
            out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
    return result


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**COMMON)


@pytest.fixture(scope="module")
def reference(llm: LLM, hf_default_model) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [hf_greedy(hf_default_model, tok(p).input_ids, NEW_TOKENS) for p in PROMPTS]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_transformers(llm: LLM, reference) -> None:
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outs] == PROMPTS  # input order
    assert token_ids(outs) == reference
    o = outs[0].outputs[0]
    assert o.finish_reason == "length" and o.text == llm.get_tokenizer().decode(o.token_ids, skip_special_tokens=True)


def test_prompt_alone_equals_prompt_in_full_batch(llm: LLM, reference) -> None:
    assert token_ids(llm.generate([PROMPTS[6]], GREEDY)) == [reference[6]]


def test_nothing_compiles_after_warm_up(llm: LLM) -> None:
    compiles: list[str] = []

    def listener(event: str, duration: float, **_) -> None:
        if "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        mixed = [
            SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1, max_tokens=7),
            SamplingParams(temperature=0.0, max_tokens=3, logprobs=5),
            SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.3,
                           frequency_penalty=0.5, presence_penalty=0.5, max_tokens=20,
                           bad_words=["the", "of a"], allowed_token_ids=list(range(2000))),
        ]
        prompts = [p * (1 + i % 4) for i, p in enumerate(PROMPTS)] * 2  # 32 prompts, up to ~160 tokens
        outs = llm.generate(prompts, [mixed[i % 3] for i in range(len(prompts))], use_tqdm=False)
        outs += llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    # Each RequestOutput keeps its trace (vLLM's metrics), and the traces agree: no step compiled.
    for o in outs:
        trace = o.metrics.trace.to_dict()
        assert trace["summary"]["num_compiles"] == 0
        assert {e["box"] for e in trace["events"]} >= {
            "engine_core", "scheduler", "kv_cache_manager", "model_runner", "sampler", "output_processor"}


def test_chunked_prefill_preemption_and_prefix_caching_keep_greedy_outputs(reference) -> None:
    # Chunked prefill (32-token steps) and prefix caching off.
    llm = LLM(**{**COMMON, "max_num_batched_tokens": 32}, enable_prefix_caching=False, enforce_eager=True)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    del llm
    # Too few pages for 16 sequences at once: requests get preempted and recomputed.
    llm = LLM(**{**COMMON, "kv_cache_memory_bytes": None}, num_gpu_blocks_override=40, enforce_eager=True)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(outs) == reference
    assert llm.engine_core.get_stats().num_preemptions > 0 or any(
        o.metrics.num_preemptions for o in outs
    )


def test_prefix_cache_hits_are_observable(llm: LLM) -> None:
    # A prefix no other test of this module's shared engine sends: the first is uncached.
    shared = "Prefix-cache test 41. You are a careful assistant. Answer briefly. " * 4
    first = llm.generate([shared + "What is 2+2?"], GREEDY, use_tqdm=False)[0]
    second = llm.generate([shared + "What is 3+3?"], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 16 * (len(llm.get_tokenizer()(shared).input_ids) // 16) - 16
    assert second.num_cached_tokens > 0


def test_seeded_sampling_is_reproducible_across_batches(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=16)
    alone = llm.generate([PROMPTS[0]], p, use_tqdm=False)
    others = SamplingParams(temperature=0.7, max_tokens=10)
    batched = llm.generate(PROMPTS[:8], [p] + [others] * 7, use_tqdm=False)
    assert token_ids(alone)[0] == token_ids(batched)[0]
    unseeded = llm.generate([PROMPTS[0]] * 2, SamplingParams(temperature=1.0, max_tokens=16), use_tqdm=False)
    assert token_ids(unseeded)[0] != token_ids(unseeded)[1]  # fresh randomness per request


def test_logprobs_and_stop_strings(llm: LLM) -> None:
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and len(entry) in (3, 4) and entry[tok].rank == 1  # greedy: rank 1
    full = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = full[5:9]
    cut = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=32, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full[: full.index(stop)]


def test_min_tokens_keeps_eos_out_and_logit_bias_forces_a_token(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no?"}],
                                   tokenize=False, add_generation_prompt=True)
    short = llm.generate([chat], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
    assert short.outputs[0].finish_reason == "stop" and len(short.outputs[0].token_ids) < 12
    # min_tokens: EOS cannot be sampled before 12 tokens exist (not merely ignored).
    for temperature in (0.0, 1.0):
        out = llm.generate([chat], SamplingParams(temperature=temperature, max_tokens=40,
                                                  min_tokens=12, seed=3), use_tqdm=False)[0]
        ids = out.outputs[0].token_ids
        assert len(ids) >= 12 and eos not in ids[:12], ids
    # logit_bias +100 on one token: sampling at temperature 1 picks it every time.
    the = tok(" the", add_special_tokens=False).input_ids[0]
    out = llm.generate(["Once upon a time"], SamplingParams(
        temperature=1.0, max_tokens=8, ignore_eos=True, logit_bias={the: 100.0}, seed=0),
        use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [the] * 8
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


def test_prompt_logprobs_equal_transformers(hf_default_model) -> None:
    """vLLM's prompt_logprobs through chunked prefill (32-token steps), twice: the second run
    must not read the prefix cache (every position is recomputed), and equal the first."""
    import torch

    llm = LLM(None, **{**COMMON, "max_num_batched_tokens": 32}, enforce_eager=True)
    prompt = " ".join(PROMPTS[6:9])
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    first, second = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    ids = first.prompt_token_ids
    assert len(ids) > 40 and first.prompt_logprobs[0] is None
    assert len(first.prompt_logprobs) == len(second.prompt_logprobs) == len(ids)
    with torch.no_grad():
        ref = torch.log_softmax(hf_default_model(torch.tensor([ids])).logits[0].float(), -1).numpy()
    for p in range(1, len(ids)):
        for out in (first, second):
            entry = out.prompt_logprobs[p]
            assert ids[p] in entry and len(entry) <= 4
            for tok, lp in entry.items():
                assert abs(lp.logprob - ref[p - 1, tok]) <= 1e-3, (p, tok, lp, ref[p - 1, tok])
            top = max(entry.values(), key=lambda lp: lp.logprob)
            assert top.rank == 1 and abs(top.logprob - ref[p - 1].max()) <= 1e-3
    llm.shutdown()
    # Dropped, the LLM frees its engine and compiled programs at once: no reference cycle
    # waits for the cyclic collector (each engine holds ~10,000 memory maps; a process that
    # kept a few past vm.max_map_count segfaulted in JAX's next cache load).
    engine, runner = weakref.ref(llm.engine_core), weakref.ref(llm.engine_core.worker.runner)
    gc.disable()
    try:
        del llm
        assert engine() is None and runner() is None
    finally:
        gc.enable()


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


def test_structured_outputs_with_sampling(llm: LLM) -> None:
    """JSON schema (nested object, enum, array), choice and regex, sampled at temperature 1
    beside an unconstrained request (async scheduling on: grammar requests skip a step while
    their token is in flight, the others overlap)."""
    import jsonschema

    tok = llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}],
                                   tokenize=False, add_generation_prompt=True)
    params = [SamplingParams(temperature=1.0, max_tokens=160, seed=i,
                             structured_outputs=("json", json.dumps(PERSON))) for i in range(3)]
    params += [SamplingParams(temperature=1.0, max_tokens=8, seed=7,
                              structured_outputs=("choice", '["yes", "no", "maybe"]')),
               SamplingParams(temperature=1.0, max_tokens=20, seed=8,
                              structured_outputs=("regex", r"\d{3}-\d{4}")),
               SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
    outs = llm.generate([chat] * 3 + ["Is the sky blue?", "Call me at", "Hello"], params,
                        use_tqdm=False)
    for o in outs[:3]:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    assert outs[3].outputs[0].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"\d{3}-\d{4}", outs[4].outputs[0].text)
    assert len(outs[5].outputs[0].token_ids) == 16


def _contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    return any(tuple(seq[i:i + len(sub)]) == sub for i in range(len(seq) - len(sub) + 1))


def test_bad_words_and_allowed_token_ids_beside_unconstrained_requests(llm: LLM, reference) -> None:
    """bad_words (one-token and longer words) never come out and allowed_token_ids bound the
    output, greedy and sampled, while unconstrained greedy requests in the same batch keep
    their reference tokens."""
    tok = llm.get_tokenizer()
    # Words the greedy continuation of PROMPTS[0] and PROMPTS[8] produces: banning them must
    # change the output.
    first = tok.decode(reference[0][:1]).strip()
    text8 = tok.decode(reference[8])
    word8 = max(text8.split(), key=len)
    bad = [first, word8]
    allowed = sorted(set(reference[3]) | set(tok(" the a of and", add_special_tokens=False).input_ids))
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, bad_words=bad),
        SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True, bad_words=bad,
                       seed=5),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                       allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                       allowed_token_ids=allowed, seed=6),
        GREEDY, GREEDY,
    ]
    prompts = [PROMPTS[0], PROMPTS[8], PROMPTS[3], PROMPTS[3], PROMPTS[1], PROMPTS[2]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    banned_seqs = {tuple(tok.encode(s, add_special_tokens=False))
                   for w in bad for s in (w, " " + w)}
    for o in outs[:2]:
        ids = o.outputs[0].token_ids
        assert len(ids) == NEW_TOKENS
        assert not any(_contains(ids, s) for s in banned_seqs), (o.outputs[0].text, bad)
    assert outs[0].outputs[0].token_ids != reference[0]
    for o in outs[2:4]:
        assert set(o.outputs[0].token_ids) <= set(allowed)
    assert token_ids(outs[4:]) == [reference[1], reference[2]]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
