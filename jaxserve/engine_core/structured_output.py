"""Structured outputs in the engine core (vLLM's StructuredOutputManager), with llguidance.

A request whose SamplingParams carry `structured_outputs = (kind, spec)` gets a grammar
matcher, compiled in a thread when it is added (llguidance releases the GIL: a large schema or
tool list takes tens of milliseconds, which would stall every stream if the engine loop did
it); the scheduler admits the request once its matcher is ready (vLLM's WAITING_FOR_FSM).
Before each step the scheduler asks for the token bitmask of the
grammar requests it scheduled (what the grammar allows next, one bit per token); the worker's
sampler masks the logits with it on the device. After the step, the sampled tokens advance
the matchers. The bitmask needs every earlier token, so under async scheduling a grammar
request is not scheduled while one of its tokens is still in flight: it decodes every other
step, and the rest of the batch keeps overlapping.

JAX-free: the engine core imports it (llguidance works on the host).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any, Literal

import numpy as np

from jaxserve.engine_core.request import InvalidRequestError, Request

logger = logging.getLogger(__name__)

# The llguidance.grammar_from formats used here (its GrammarFormat, without importing it).
_GrammarFormat = Literal["json_schema", "regex", "choice", "grammar"]

# kind -> llguidance.grammar_from's format; json_object is "any JSON object".
KINDS: dict[str, _GrammarFormat] = {"json": "json_schema", "json_object": "json_schema", "regex": "regex",
         "choice": "choice", "grammar": "grammar"}


def grammar_text(kind: str, spec: str, validate: bool = True) -> str:
    """The llguidance grammar of a (kind, spec) pair; raises ValueError if it is invalid
    (`validate=False`: only if it cannot be read; the matcher built from it reports the rest)."""
    import llguidance

    if kind not in KINDS:
        raise ValueError(f"unknown structured output kind {kind!r} (one of {sorted(KINDS)})")
    if kind == "json_object":
        spec = '{"type": "object"}'
    if kind == "choice":
        _check_choices(spec)
    try:
        grammar = llguidance.grammar_from(KINDS[kind], spec)
    except (ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"invalid {kind}: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar) if validate else None
    if error:
        raise ValueError(f"invalid {kind}: {error.strip().splitlines()[0]}")
    return grammar


def _check_choices(spec: str) -> None:
    """A choice list the grammar engine can follow: at least one string, and fewer than its
    parser's items per row (one per choice, one more: past that it fails mid-generation)."""
    import llguidance

    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid choice: {e}") from None
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise ValueError("invalid choice: it must be a list of strings")
    if not choices:
        raise ValueError("invalid choice: the list is empty")
    limit = llguidance.LLParserLimits().max_items_in_row - 1
    if len(choices) > limit:
        raise ValueError(f"invalid choice: {len(choices)} strings, but the grammar engine "
                         f"(llguidance) follows at most {limit}")


def close_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema that does not say
    (vLLM's disable_additional_properties), through properties, items, combinators and $defs."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (close_objects(v) if k in _SUBSCHEMA_LISTS or k in _SUBSCHEMAS else
               {n: close_objects(s) for n, s in v.items()} if k in _SUBSCHEMA_MAPS
               and isinstance(v, dict) else v)
           for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = {"items", "additionalProperties", "not", "if", "then", "else", "contains"}
_SUBSCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
_SUBSCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions"}


class StructuredOutputManager:
    """Grammar matchers of the engine core's structured-output requests."""

    def __init__(self, load_tokenizer: Callable[[], Any] | None = None, vocab_size: int = 0,
                 disable_additional_properties: bool = False) -> None:
        """Without `load_tokenizer` (a scheduler built alone), grammar requests are refused."""
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.disable_additional_properties = disable_additional_properties
        self._ll_tokenizer: Any = None
        self.matchers: dict[str, Any] = {}
        self.compiling: dict[str, concurrent.futures.Future[Any]] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        if load_tokenizer is not None:
            # The grammar engine's view of the vocabulary (seconds of Python for a GGUF's
            # tokenizer), built now in the compile thread: built by the first grammar request,
            # it held the GIL long enough to stall every stream.
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="jaxserve-grammar")
            self._executor.submit(self._tokenizer)

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            # Only add_request's matchers call this, and it refuses grammars without a tokenizer.
            assert self._load_tokenizer is not None
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self._load_tokenizer(),
                                                              n_vocab=self.vocab_size)
        return self._ll_tokenizer

    def add_request(self, request: Request) -> None:
        """Start compiling `request`'s matcher if it has a grammar (`ready` says when it is
        done); InvalidRequestError if the engine cannot run grammars at all."""
        if request.sampling_params.structured_outputs is None:
            return
        if self._load_tokenizer is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer (not "
                                      "available in this engine: skip_tokenizer_init?)")
        assert self._executor is not None
        kind, spec = request.sampling_params.structured_outputs
        self.compiling[request.req_id] = self._executor.submit(self._compile, kind, spec)

    def _compile(self, kind: str, spec: str) -> Any:
        import llguidance

        if kind == "json" and self.disable_additional_properties:
            try:
                spec = json.dumps(close_objects(json.loads(spec)))
            except json.JSONDecodeError:
                pass  # the matcher reports the schema's error
        # Not validated first: the matcher compiles the grammar anyway and says if it fails.
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar_text(kind, spec, validate=False))
        if matcher.is_error():
            raise ValueError(f"invalid {kind}: {matcher.get_error()}")
        return matcher

    def ready(self, req_id: str) -> bool | str:
        """Whether `req_id` can be scheduled: True (no grammar, or its matcher is ready),
        False (still compiling), or the compile error's text (the request must end)."""
        future = self.compiling.get(req_id)
        if future is None:
            return True
        if not future.done():
            return False
        del self.compiling[req_id]
        try:
            self.matchers[req_id] = future.result()
        except Exception as e:  # noqa: BLE001 - the grammar's fault, reported on the request
            return f"structured output failed: {str(e).splitlines()[0] if str(e) else e!r}"
        return True

    def wait_compiling(self, timeout_s: float) -> None:
        """Block until a compile ends or `timeout_s` passes (an engine with nothing else to
        do waits here rather than spinning)."""
        if self.compiling:
            concurrent.futures.wait(list(self.compiling.values()), timeout_s,
                                    concurrent.futures.FIRST_COMPLETED)

    def step_bitmasks(self, req_ids: Iterable[str]) -> dict[str, np.ndarray] | None:
        """The bitmask of each of `req_ids` that has a grammar (None if none has)."""
        if not self.matchers:
            return None
        return {r: self.bitmask(r) for r in req_ids if r in self.matchers} or None

    def remove_request(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        future = self.compiling.pop(req_id, None)
        if future is not None:
            future.cancel()

    def accept_tokens(self, req_id: str, token_ids: list[int]) -> str | None:
        """Advance `req_id`'s matcher; the grammar engine's error if it cannot (the scheduler
        then ends the request), else None."""
        matcher = self.matchers.get(req_id)
        if matcher is not None and not matcher.is_stopped():
            if not matcher.consume_tokens(token_ids):
                error = matcher.get_error() or "the grammar rejected the token"
                logger.warning("request %s: token(s) %s rejected by its grammar: %s", req_id,
                               token_ids, error)
                return f"structured output failed: {error.splitlines()[0]}"
        return None

    def bitmask(self, req_id: str) -> np.ndarray:
        """int32[ceil(vocab / 32)]: bit t of word t // 32 set = token t allowed next."""
        import llguidance.numpy

        mask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(self.matchers[req_id], mask, 0)
        return mask[0]
