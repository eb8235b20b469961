"""Front-end output processing: token ids -> text, stop strings, RequestOutputs.

Shared by the offline `LLM` and the API server (JAX-free). The engine core only
knows token ids; here each sequence is detokenized incrementally (tokenizers'
DecodeStream, O(1) per token), stop strings are searched in the new text, and
a request that hit one is reported so the caller aborts it in the engine core.

A character whose UTF-8 bytes are split over several tokens reaches the text only once
its last byte is there (DecodeStream holds the bytes back, as vLLM's detokenizer does), so
no stream ever shows U+FFFD for it. The logprobs' decoded tokens follow the same rule: the
token that completes the character carries it, the ones before it carry "" (vLLM's
LogprobsProcessor._verify_tokens).

A request with `n > 1` fans out into n child sequences `"{request_id}-{i}"`,
each with its own seed (`seed + i` when a seed is given), gathered back into
one RequestOutput.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from jaxserve.engine_core.core_outputs import EngineCoreEventType, EngineCoreOutput
from jaxserve.engine_core.model_runner_output import LogprobsLists
from jaxserve.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    FinishReason,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from jaxserve.pooling_params import PoolingParams
from jaxserve.request_trace import RequestTrace
from jaxserve.sampling_params import SamplingParams


@dataclass
class _Sequence:
    index: int
    params: SamplingParams
    stream: DecodeStream
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index, text=self.text, token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob, logprobs=self.logprobs,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
        )


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Sequence]
    metrics: RequestMetrics
    trace: RequestTrace | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    pooling: PoolingParams | None = None  # an embedding request
    embedding: list[float] | list[list[float]] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}-{index}"


class OutputProcessor:
    def __init__(self, tokenizer: Any, request_tracing: bool = True) -> None:
        """`request_tracing`: keep a RequestTrace per request (RequestMetrics.trace)."""
        self.tokenizer = tokenizer  # None (skip_tokenizer_init): token ids only, no text
        self.request_tracing = request_tracing
        # The Rust tokenizer DecodeStream needs.
        self._backend = None if tokenizer is None else tokenizer.backend_tokenizer
        self.requests: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
        trace: RequestTrace | None = None, pooling_params: PoolingParams | None = None,
    ) -> list[tuple[str, SamplingParams]]:
        """Register a request; returns the (engine request id, params) of each sequence.
        `trace`: the request's trace so far (the API server's); else a new one.
        `pooling_params`: an embedding request (one sequence; `params` is its one token)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if pooling_params is not None and params.n != 1:
            raise ValueError("an embedding request has one sequence (n=1)")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set): "
                             "use stop_token_ids")
        children = []
        seqs = []
        for i in range(params.n):
            p = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i
            )
            cid = child_id(request_id, i, params.n)
            self._child_to_parent[cid] = (request_id, i)
            children.append((cid, p))
            seqs.append(_Sequence(i, p, DecodeStream(skip_special_tokens=p.skip_special_tokens),
                                  logprobs=[] if p.logprobs is not None else None,
                                  cumulative_logprob=0.0 if p.logprobs is not None else None))
        if trace is None and self.request_tracing:
            trace = RequestTrace(request_id)
        if trace is not None:
            trace.num_prompt_tokens = len(prompt_token_ids)
        metrics = RequestMetrics(time.monotonic(), trace=trace)
        self.requests[request_id] = _RequestState(
            request_id, prompt, list(prompt_token_ids), seqs, metrics, trace,
            pooling=pooling_params)
        return children

    def child_ids(self, request_id: str) -> list[str]:
        """Engine request ids of a request's sequences ([] if unknown)."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        return [child_id(request_id, s.index, len(state.seqs)) for s in state.seqs]

    def abort_request(self, request_id: str) -> None:
        """Forget a request (the caller aborts its children in the engine core)."""
        for cid in self.child_ids(request_id):
            self._child_to_parent.pop(cid, None)
        self.requests.pop(request_id, None)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput | EmbeddingRequestOutput], list[str]]:
        """Apply one step's outputs. Returns the RequestOutputs of the requests that
        changed and the engine ids of sequences to abort (they hit a stop string)."""
        changed: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        now = time.monotonic()
        for out in outputs:
            parent = self._child_to_parent.get(out.req_id)
            if parent is None:
                continue  # aborted meanwhile
            state = self.requests[parent[0]]
            seq = state.seqs[parent[1]]
            if seq.finish_reason is not None:
                continue
            t0 = time.perf_counter()
            self._record_events(state, out, now)
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                # Every sequence of an n > 1 request brings the same rows: keep the first.
                state.prompt_logprobs = [None, *self._logprob_entries(out.prompt_logprobs,
                                                                      state.prompt_token_ids)]
            if out.pooling_output is not None:
                state.embedding = out.pooling_output
            if self._append(seq, out):
                to_abort.append(out.req_id)
            elif out.finish_reason is not None:
                seq.finish_reason = out.finish_reason.value
                seq.stop_reason = out.stop_reason
            if state.trace is not None:
                self._trace_output(state.trace, seq, out, time.perf_counter() - t0)
            changed[state.request_id] = state
        results = []
        for state in changed.values():
            if state.finished:
                state.metrics.finished_time = now
                if state.trace is not None:
                    state.trace.finished = t = time.time()
                    state.trace.add("output_processor", "finished", t, reasons=[
                        s.finish_reason for s in state.seqs])
                self.abort_request(state.request_id)
            results.append(self._make_output(state))
        return results, to_abort

    def _append(self, seq: _Sequence, out: EngineCoreOutput) -> bool:
        """Detokenize new tokens; True if a stop string ended the sequence."""
        p = seq.params
        for i, tok in enumerate(out.new_token_ids):
            if out.new_logprobs is not None and seq.logprobs is not None:
                # Named after the tokens before it (a character split over tokens).
                seq.logprobs.append(self._logprob_entry(out.new_logprobs, i, seq.token_ids))
                seq.cumulative_logprob = ((seq.cumulative_logprob or 0.0)
                                          + out.new_logprobs.logprobs[i][0])
            seq.token_ids.append(tok)
            # The token that ended the sequence (EOS or a stop token id) is not text unless
            # include_stop_str_in_output asks for it (vLLM's detokenizer); with
            # skip_special_tokens false, that is how the EOS text ends the output.
            is_last_stop = out.finish_reason == FinishReason.STOP and i == len(out.new_token_ids) - 1 \
                and isinstance(out.stop_reason, int | type(None))
            if is_last_stop and not p.include_stop_str_in_output:
                break
            if self._backend is None:
                continue  # no tokenizer: token ids only
            piece = self._step(seq, self._backend, tok)
            if not piece:
                continue
            start = max(len(seq.text) - _max_stop_len(p) + 1, 0)
            seq.text += piece
            if p.stop and self._check_stop_strings(seq, start):
                return True
        return False

    @staticmethod
    def _step(seq: _Sequence, backend: Tokenizer, tok: int) -> str | None:
        """The text `tok` adds to `seq` (None while a character's bytes are incomplete)."""
        try:
            return seq.stream.step(backend, tok)
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            # A tokenizer whose decoding is not monotonic can leave DecodeStream's state
            # inconsistent; start a fresh stream at this token, as vLLM does.
            seq.stream = DecodeStream(skip_special_tokens=seq.params.skip_special_tokens)
            return seq.stream.step(backend, tok)

    @staticmethod
    def _check_stop_strings(seq: _Sequence, search_from: int) -> bool:
        for stop in seq.params.stop or ():
            idx = seq.text.find(stop, search_from)
            if idx != -1:
                end = idx + len(stop) if seq.params.include_stop_str_in_output else idx
                seq.text = seq.text[:end]
                seq.finish_reason = FinishReason.STOP.value
                seq.stop_reason = stop
                return True
        return False

    def _entry(self, ids: list[int], vals: list[float], rank: int,
               context: list[int]) -> dict[int, Logprob]:
        """{token: Logprob} for a row: its token (with `rank`), then the top-N by rank.
        `context`: the tokens before this position (the sequence's or the prompt's)."""
        entry = {ids[0]: Logprob(vals[0], rank, self._decoded_token(ids[0], context))}
        for r, (t, v) in enumerate(zip(ids[1:], vals[1:]), start=1):
            if t not in entry:
                entry[t] = Logprob(v, r, self._decoded_token(t, context))
        return entry

    def _decoded_token(self, token: int, context: list[int]) -> str | None:
        """The text `token` adds after `context`, as a logprob names it (None without a
        tokenizer). A token alone ending in U+FFFD holds part of a character: it names ""
        until the token that completes the character, which names the whole character."""
        if self.tokenizer is None:
            return None
        text: str = self.tokenizer.decode([token])
        if not text.endswith(_REPLACEMENT):
            return text
        for n in range(1, min(len(context), _MAX_CONTEXT) + 1):
            tail = context[-n:]
            whole: str = self.tokenizer.decode([*tail, token])
            if whole.endswith(_REPLACEMENT):
                continue
            # The tail's tokens that end inside the character gave no text of their own:
            # what this token names starts after the last complete prefix of the tail.
            kept = next(m for m in range(n - 1, -1, -1)
                        if not self.tokenizer.decode(tail[:m]).endswith(_REPLACEMENT))
            prefix: str = self.tokenizer.decode(tail[:kept])
            if not whole.startswith(prefix):  # a decoder that reshapes joins (spaces)
                prefix = whole[:len(os.path.commonprefix([prefix, whole]))]
            return whole[len(prefix):]
        return ""  # the character is still incomplete here

    def _logprob_entries(self, lp: LogprobsLists, prompt: list[int]
                         ) -> list[dict[int, Logprob] | None]:
        """Prompt logprobs: row j is prompt position j + 1, after the tokens before it (the
        last few: _decoded_token reads at most _MAX_CONTEXT)."""
        return [self._entry(ids, vals, rank, prompt[max(j + 1 - _MAX_CONTEXT, 0):j + 1])
                for j, (ids, vals, rank)
                in enumerate(zip(lp.token_ids, lp.logprobs, lp.sampled_token_ranks))]

    def _logprob_entry(self, lp: LogprobsLists, i: int, context: list[int]) -> dict[int, Logprob]:
        """Row `i` of a step's logprobs (the sequence's i-th new token)."""
        return self._entry(lp.token_ids[i], lp.logprobs[i], lp.sampled_token_ranks[i], context)

    @staticmethod
    def _trace_output(trace: RequestTrace, seq: _Sequence, out: EngineCoreOutput,
                      busy_s: float) -> None:
        k = seq.index
        if out.events:
            trace.add_engine_events(out.events, k)
        if out.trace_steps:
            trace.add_steps(out.trace_steps, k)
        trace.num_cached_tokens = max(trace.num_cached_tokens, out.num_cached_tokens)
        trace.record_output(time.time(), busy_s, len(out.new_token_ids))
        if seq.finish_reason is not None:
            trace.finish_reasons[k] = seq.finish_reason

    @staticmethod
    def _record_events(state: _RequestState, out: EngineCoreOutput, now: float) -> None:
        m = state.metrics
        for e in out.events or ():
            if e.type == EngineCoreEventType.SCHEDULED and m.first_scheduled_time is None:
                m.first_scheduled_time = e.timestamp
            elif e.type == EngineCoreEventType.PREEMPTED:
                m.num_preemptions += 1
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now

    @staticmethod
    def _make_output(state: _RequestState) -> RequestOutput | EmbeddingRequestOutput:
        if state.pooling is not None:
            return EmbeddingRequestOutput(
                state.request_id, state.prompt_token_ids,
                None if state.embedding is None else EmbeddingOutput(state.embedding),
                state.finished, state.metrics, state.num_cached_tokens)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[s.to_output() for s in state.seqs],
            finished=state.finished,
            metrics=state.metrics,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
        )


_REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence ends with
# UTF-8 characters have at most 4 bytes: at most 3 tokens before a token hold the rest of
# the character it ends.
_MAX_CONTEXT = 3
# The start of the error tokenizers' DecodeStream raises when its state went wrong.
_INVALID_PREFIX = "Invalid prefix encountered"


def _max_stop_len(p: SamplingParams) -> int:
    return max((len(s) for s in p.stop), default=1) if p.stop else 1
