"""The scheduler's request checks: can a new request ever run, and does a sampled token
end a request (vLLM's sched/utils.check_stop).

Stop strings are not here: they need detokenized text and are checked by the
front end, which then aborts the request.
"""

from __future__ import annotations

from jaxserve.engine_core.request import InvalidRequestError, Request, RequestStatus

EMPTY_PROMPT = "prompt is empty"


def prompt_too_long(num_prompt_tokens: int, max_model_len: int) -> str:
    """The refusal of a prompt with no room for an output token (the input processor's words
    too: engine/processor.py)."""
    return (f"prompt has {num_prompt_tokens} tokens but max_model_len is {max_model_len} "
            "(it must leave room for at least one output token)")


def check_new_request(request: Request, max_model_len: int) -> None:
    """Raises InvalidRequestError for a request that can never run: a backstop for callers
    that skip the input processor, in its words."""
    if request.num_prompt_tokens == 0:
        raise InvalidRequestError(EMPTY_PROMPT)
    if request.num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(prompt_too_long(request.num_prompt_tokens, max_model_len))
    p = request.sampling_params
    if p.bad_words and not p.bad_words_token_ids:
        raise InvalidRequestError("bad_words must be tokenized by the input processor "
                                  "(SamplingParams.bad_words_token_ids)")


def waits_for_tokens_in_flight(request: Request, max_model_len: int) -> bool:
    """Async scheduling: whether a request with output placeholders sits this step out,
    because the tokens in flight already end it, or its grammar's next mask needs them."""
    placeholders = request.num_output_placeholders
    return (
        request.num_output_tokens + placeholders >= request.max_tokens
        or request.num_tokens + placeholders >= max_model_len
        or request.sampling_params.structured_outputs is not None
    )


def append_until_stop(request: Request, new_token_ids: list[int], max_model_len: int
                      ) -> tuple[list[int], bool]:
    """Append tokens up to a stop; returns the tokens kept and whether it stopped."""
    for num_new, token_id in enumerate(new_token_ids, 1):
        request.append_output_token_ids(token_id)
        if check_stop(request, token_id, max_model_len):
            return new_token_ids[:num_new], True
    return new_token_ids, False


def check_stop(request: Request, last_token_id: int, max_model_len: int) -> bool:
    """Whether `last_token_id` (just appended) ends the request; sets its
    FINISHED_* status and stop_reason.

    Order: min_tokens suppresses EOS and stop_token_ids; EOS unless
    ignore_eos; stop_token_ids; max_tokens; max_model_len. So a request whose
    last allowed token is EOS reports "stop", not "length". max_model_len is
    never suppressed by min_tokens: there is no room for another token.
    """
    if request.pooling_params is not None:  # its one token is the end of its prompt
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    num_output_tokens = request.num_output_tokens
    params = request.sampling_params
    if num_output_tokens >= params.min_tokens:
        if last_token_id == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in (params.stop_token_ids or ()):  # never None once built
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    if num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
