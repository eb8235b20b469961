"""The input processor (jaxserve/engine/processor.py): one set of checks of a request against
the served model, shared by the offline LLM and the API server; each refusal names its field."""

from __future__ import annotations

import pytest

from jaxserve.engine.processor import InvalidInputError, Processor
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

P = Processor(max_model_len=100, vocab_size=1000, model_eos_token_ids=frozenset({7}),
              max_logprobs=5)


def refused(fn, *args, **kwargs) -> InvalidInputError:
    with pytest.raises(InvalidInputError) as e:
        fn(*args, **kwargs)
    assert isinstance(e.value, ValueError)  # offline: a ValueError
    return e.value


def test_prompts_against_the_context_and_the_vocabulary() -> None:
    assert P.check_prompt([1, 2, 3], None) == 97  # as many as fit
    assert P.check_prompt([1, 2, 3], 97) == 97
    cases = [([], None, "prompt", "prompt is empty"),
             (list(range(100)), None, "prompt", "prompt has 100 tokens but max_model_len is 100"),
             ([1, 1000], None, "prompt", "Token id 1000 is out of vocabulary: prompt token ids must be in [0, 1000)"),
             ([-1, *range(1000, 1010)], None, "prompt", "-1, 1000, 1001, 1002, 1003 and 6 more"),
             ([1, 2], 99, "max_tokens", "lower max_tokens to at most 98")]
    for ids, max_tokens, param, message in cases:
        e = refused(P.check_prompt, ids, max_tokens)
        assert e.param == param and message in str(e)


def test_sampling_params_against_the_model() -> None:
    params = P.make_params(temperature=0.5, stop_token_ids=[3])
    assert set(params.stop_token_ids) == {3, 7}  # the model's EOS ids stop it too
    for kwargs, param in [({"logit_bias": {1000: 1.0}}, "logit_bias"), ({"top_k": 1001}, "top_k"),
                          ({"stop_token_ids": [1000]}, "stop_token_ids"),
                          ({"logprobs": 6}, "logprobs"), ({"prompt_logprobs": 6}, "prompt_logprobs"),
                          ({"temperature": -1.0}, "temperature")]:
        e = refused(P.make_params, **kwargs)
        assert e.param == param and ("1000" in str(e) or param not in ("logit_bias", "stop_token_ids"))
    assert P.check_params(SamplingParams(logprobs=5)).logprobs == 5


def test_grammars_are_compiled_before_the_request_is_taken() -> None:
    assert P.check_grammar("regex", "[a-z]+", "structured_outputs") == ("regex", "[a-z]+")
    e = refused(P.check_grammar, "json", "{not json", "response_format")
    assert e.param == "response_format"


def test_bad_words_are_tokenized_both_ways_and_allowed_ids_checked() -> None:
    # " cat" is the space and then "cat": the bare spelling covers it (vLLM's rule).
    words = {"cat": [5], " cat": [6, 5], "dog house": [8, 9], " dog house": [10, 9]}
    p = Processor(100, 1000, encode=lambda text: words[text])
    params = p.make_params(bad_words=["cat", " dog house"])
    assert params.bad_words_token_ids == ((5,), (8, 9), (10, 9))
    assert params.bans_by_history  # a word of several tokens: no speculative drafts
    assert p.make_params(allowed_token_ids=[3, 1]).allowed_token_ids == (3, 1)
    assert refused(p.make_params, allowed_token_ids=[1000]).param == "allowed_token_ids"
    assert refused(p.make_params, bad_words=["cat"] * 0 + [""]).param == "bad_words"
    assert refused(P.make_params, bad_words=["cat"]).param == "bad_words"  # no tokenizer
    too_long = Processor(100, 1000, encode=lambda text: list(range(17)))
    e = refused(too_long.make_params, bad_words=["long"])
    assert e.param == "bad_words" and "1 to 16 tokens" in str(e)


def test_embedding_requests_against_the_model() -> None:
    assert P.pooling_params() == PoolingParams("LAST", True)  # --pooler-config's defaults
    assert P.pooling_params(normalize=False) == PoolingParams("LAST", False)
    assert refused(P.pooling_params, dimensions=8).param == "dimensions"
    assert refused(P.pooling_params, normalize="yes").param == "normalize"
    P.check_pooling_prompt([1] * 99)
    e = refused(P.check_pooling_prompt, [1] * 100)
    assert e.param == "input" and "at most 99" in str(e)
    assert refused(P.check_pooling_prompt, []).param == "prompt"
    assert refused(P.check_pooling_prompt, [1000]).param == "prompt"
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams("STEP")
