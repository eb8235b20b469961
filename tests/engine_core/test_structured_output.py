"""The engine core's grammar matchers (llguidance) on the default model's tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.engine_core.request import InvalidRequestError, Request
from jaxserve.engine_core.structured_output import StructuredOutputManager, grammar_text
from jaxserve.models.tokenizer import load_tokenizer
from jaxserve.sampling_params import SamplingParams


def allowed(mask: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])


def compiled(so: StructuredOutputManager, req_id: str) -> None:
    """Wait for the request's matcher (compiled in a thread) and install it."""
    so.compiling[req_id].result()
    assert so.ready(req_id) is True


def test_matchers_follow_the_tokens_and_end_at_eos() -> None:
    tok = load_tokenizer(None)
    so = StructuredOutputManager(lambda: tok, 49152)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    so.add_request(Request("r", [1], SamplingParams(structured_outputs=("json", json.dumps(schema)))))
    compiled(so, "r")
    first = {tok.decode([t]) for t in allowed(so.bitmask("r"), 49152)}
    assert first and all(s.startswith("{") for s in first)
    so.accept_tokens("r", tok('{"a": 12}', add_special_tokens=False).input_ids)
    assert allowed(so.bitmask("r"), 49152).tolist() == [tok.eos_token_id]
    so.remove_request("r")
    assert not so.matchers


@pytest.mark.parametrize("kind, spec", [("json", '{"type": "nonsense"}'), ("regex", "[a-z"),
                                        ("choice", "not json"), ("grammar", "start: ?!"),
                                        ("yaml", "x")])
def test_bad_grammars_are_value_errors(kind: str, spec: str) -> None:
    with pytest.raises(ValueError):
        grammar_text(kind, spec)


def test_sampling_params_check_the_pair() -> None:
    assert SamplingParams(structured_outputs=["regex", "a+"]).structured_outputs == ("regex", "a+")
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=("yaml", "x"))


def test_a_scheduler_without_a_tokenizer_refuses_grammar_requests() -> None:
    with pytest.raises(InvalidRequestError, match="not available"):
        StructuredOutputManager().add_request(
            Request("r", [1], SamplingParams(structured_outputs=("regex", "a+"))))


def test_choice_lists_the_grammar_engine_cannot_follow_are_refused() -> None:
    with pytest.raises(ValueError, match="the list is empty"):
        grammar_text("choice", "[]")
    with pytest.raises(ValueError, match="5000 strings, but the grammar engine"):
        grammar_text("choice", json.dumps([f"option {i}" for i in range(5000)]))
    grammar_text("choice", json.dumps([f"option {i}" for i in range(1999)]))  # the most it follows


def test_a_matcher_that_fails_mid_generation_ends_the_request_with_an_error() -> None:
    """The sampler masks with the grammar, so a rejected token means the grammar engine itself
    failed: fed a token outside the grammar, the request finishes with "error", never goes on
    unconstrained."""
    from jaxserve.engine_core.model_runner_output import ModelRunnerOutput
    from jaxserve.outputs import FinishReason

    from .helpers import make_scheduler, schedule

    tok = load_tokenizer(None)
    sched = make_scheduler()
    sched.structured_output = StructuredOutputManager(lambda: tok, 49152)
    sched.add_request(Request("g", [1, 2, 3], SamplingParams(
        max_tokens=8, structured_outputs=("regex", "[0-9]+"))))
    sched.structured_output.compiling["g"].result()
    so = schedule(sched)
    letter = tok("x", add_special_tokens=False).input_ids[0]
    (out,) = sched.update_from_output(so, ModelRunnerOutput(["g"], {"g": 0}, [[letter]]))
    assert out.finish_reason is FinishReason.ERROR
    assert "structured output failed" in out.stop_reason
    assert not sched.has_unfinished_requests() and "g" not in sched.structured_output.matchers


def test_disable_additional_properties_closes_the_schemas_objects() -> None:
    """vLLM's structured_outputs_config.disable_additional_properties: an object that does not
    say additionalProperties takes no other keys, so a model cannot add keys forever."""
    from jaxserve.engine_core.structured_output import close_objects

    tok = load_tokenizer(None)
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "array", "items": {"type": "object"}}},
              "required": ["a"]}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["b"]["items"]["additionalProperties"] is False
    assert close_objects({"type": "object", "additionalProperties": True}) == {
        "type": "object", "additionalProperties": True}  # what the schema says stands
    for disable, comma_allowed in ((False, True), (True, False)):
        so = StructuredOutputManager(lambda: tok, 49152, disable_additional_properties=disable)
        so.add_request(Request("r", [1], SamplingParams(
            structured_outputs=("json", json.dumps({**schema, "required": ["a", "b"]})))))
        compiled(so, "r")
        so.accept_tokens("r", tok('{"a": 1, "b": []', add_special_tokens=False).input_ids)
        nxt = {tok.decode([t]) for t in allowed(so.bitmask("r"), 49152)}
        assert any(s.lstrip().startswith(",") for s in nxt) == comma_allowed, sorted(nxt)[:20]


def test_grammars_compile_off_the_engine_loop() -> None:
    """A request waits (unscheduled, behind nothing) while its grammar compiles in a thread; a
    grammar that fails to compile ends its request with the error, without a step."""
    from jaxserve.outputs import FinishReason

    from .helpers import make_scheduler

    tok = load_tokenizer(None)
    sched = make_scheduler()
    sched.structured_output = StructuredOutputManager(lambda: tok, 49152)
    gate = __import__("threading").Event()
    compile_ = sched.structured_output._compile
    sched.structured_output._compile = lambda *a: (gate.wait(), compile_(*a))[1]
    sched.add_request(Request("g", [1, 2, 3], SamplingParams(
        max_tokens=8, structured_outputs=("regex", "[0-9]+"))))
    sched.add_request(Request("plain", [4, 5, 6], SamplingParams(max_tokens=8)))
    first = sched.schedule()
    assert set(first.num_scheduled_tokens) == {"plain"}  # g still compiling: not in the way
    gate.set()
    sched.structured_output.compiling["g"].result()
    assert "g" in sched.schedule().num_scheduled_tokens
    sched.structured_output._compile = compile_
    sched.add_request(Request("bad", [1], SamplingParams(
        max_tokens=8, structured_outputs=("json", '{"type": "nonsense"}'))))
    sched.structured_output.compiling["bad"].exception()
    sched.schedule()
    (out,) = sched.take_unstepped_outputs()
    assert out.req_id == "bad" and out.finish_reason is FinishReason.ERROR
    assert "structured output failed" in out.stop_reason and "bad" not in sched.requests
