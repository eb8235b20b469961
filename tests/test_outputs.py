"""User-facing output types (jaxserve/outputs.py)."""

from jaxserve.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput


def test_finish_reason_values_are_openai_strings():
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error"]
    assert str(FinishReason.LENGTH) == "length"


def test_completion_and_request_output():
    c = CompletionOutput(0, "hi", [1, 2], None, None)
    assert not c.finished()
    c.finish_reason = FinishReason.STOP.value
    assert c.finished()
    m = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0)
    assert m.time_in_queue == 0.5 and m.time_to_first_token == 1.0
    out = RequestOutput("r", "p", [5], [c], True, m)
    assert out.outputs[0].token_ids == [1, 2] and out.num_cached_tokens is None
