"""SamplingParams: vLLM's defaults and ranges; every error names its field."""

import dataclasses

import pytest

from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (16, 0, None, None)
    assert p.stop == () and p.stop_token_ids == ()
    assert p.skip_special_tokens and not p.include_stop_str_in_output and not p.ignore_eos


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", True),
        ("temperature", -1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("seed", 1.5),
        ("max_tokens", 0),
        ("max_tokens", None),
        ("min_tokens", -1),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("logprobs", -1),
        ("logprobs", MAX_LOGPROBS + 1),
        ("ignore_eos", 1),
    ],
)
def test_invalid_value_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_error_message_says_what_was_wrong():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_boundaries_are_accepted():
    SamplingParams(temperature=0, top_p=1.0, top_k=1, min_p=1.0, presence_penalty=-2,
                   frequency_penalty=2, logprobs=MAX_LOGPROBS, seed=-7)
    SamplingParams(logprobs=0)


def test_top_k_minus_one_and_zero_both_mean_off():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_stop_is_normalised_to_a_tuple():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_frozen_and_hashable():
    p = SamplingParams(stop=["x"], stop_token_ids=[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(stop="x", stop_token_ids=(1,)))


def test_all_stop_token_ids_includes_eos_unless_ignored():
    p = SamplingParams(stop_token_ids=[5, 6])
    assert p.all_stop_token_ids(2) == {2, 5, 6}
    assert p.all_stop_token_ids(None) == {5, 6}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids(2) == {5}


def test_sampling_type():
    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.7).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=1).sampling_type is SamplingType.RANDOM_SEED


def test_logit_bias_is_validated_and_stored_sorted() -> None:
    assert SamplingParams(logit_bias={5: 1, 3: -2.5}).logit_bias == ((3, -2.5), (5, 1))
    assert SamplingParams(logit_bias=[[5, 1]]).logit_bias == ((5, 1),)  # as msgpack sends it
    for bad in ({1: 101}, {-1: 1}, {"a": 1}, {i: 1 for i in range(301)}, {1: True}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_model_eos_ids_join_stop_token_ids_unless_ignore_eos() -> None:
    p = SamplingParams(stop_token_ids=[9]).with_model_eos({2, 7, 9})
    assert p.stop_token_ids == (9, 2, 7)
    assert SamplingParams(ignore_eos=True).with_model_eos({7}).stop_token_ids == ()
    assert SamplingParams().with_model_eos(set()).stop_token_ids == ()


def test_model_eos_token_ids_from_config_and_generation_config(tmp_path) -> None:
    import json

    from jaxserve.models.model_files import ModelFiles, ModelFormat, model_eos_token_ids, resolve_model

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert model_eos_token_ids(ModelFiles(str(tmp_path), ModelFormat.HF, "m")) == {5, 7}
    assert model_eos_token_ids(resolve_model(None)) == {2}  # the default GGUF's <|im_end|>
