"""The engine core's grammar matchers (llguidance) on the default model's tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.engine_core.request import InvalidRequestError, Request
from jaxserve.engine_core.structured_output import StructuredOutputManager, grammar_text
from jaxserve.sampling_params import SamplingParams
from jaxserve.models.tokenizer import load_tokenizer


def allowed(mask: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])


def test_matchers_follow_the_tokens_and_end_at_eos() -> None:
    tok = load_tokenizer(None)
    so = StructuredOutputManager(lambda: tok, 49152)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    so.add_request(Request("r", [1], SamplingParams(structured_outputs=("json", json.dumps(schema)))))
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
