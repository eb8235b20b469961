"""vLLM's behaviour to the last field in streams and token ids (issue 75, items 3-6 and 9):
echo with a continued message, forced tool calls cut by max_tokens, token ids beside the
text, characters split over tokens, prompt logprobs in chat, and the last chunk's finish.

The detokenizer's held-back bytes are checked first without a server (the default model's
tokenizer, the real OutputProcessor); the rest through the openai client against the
session's `agent_server` (conftest.py: hermes tool parsing, otherwise a plain server), so
this file starts no server of its own.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import openai
import pytest

from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine_core.core_outputs import EngineCoreOutput
from jaxserve.engine_core.model_runner_output import LogprobsLists
from jaxserve.outputs import FinishReason, RequestOutput
from jaxserve.sampling_params import SamplingParams

from .server_utils import RemoteServer

MODEL = "SmolLM2-135M-Instruct"
EMOJI = "\U0001f600"  # four UTF-8 bytes: f0 9f 98 80
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from jaxserve.models.tokenizer import load_tokenizer

    return load_tokenizer(None)


def byte_token(tokenizer: Any, data: bytes) -> int | None:
    """The id of the byte-level token spelling exactly `data` (None if the vocab has none)."""
    # Byte-level BPE spells each byte as one character: itself when printable, else the
    # next free one from 256 up (GPT-2's table).
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    tid: int | None = tokenizer.backend_tokenizer.get_vocab().get("".join(table[b] for b in data))
    return tid


def emoji_splits(tokenizer: Any) -> list[list[int]]:
    """Every way the vocab can spell the emoji in two or more tokens (its bytes split at
    each possible point the vocab allows: one byte a token, and the two-byte head)."""
    data = EMOJI.encode()
    found = []
    for cuts in itertools.chain.from_iterable(
            itertools.combinations(range(1, len(data)), k) for k in range(1, len(data))):
        bounds = [0, *cuts, len(data)]
        ids = [byte_token(tokenizer, data[a:b]) for a, b in zip(bounds, bounds[1:])]
        if all(t is not None for t in ids):
            found.append([t for t in ids if t is not None])
    assert [len(s) for s in found] == [3, 4]  # f09f|98|80 and f0|9f|98|80 in this vocab
    return found


def compositions(n: int) -> list[list[int]]:
    """Every way to cut n tokens into consecutive steps (the sizes of the steps)."""
    out = []
    for cuts in itertools.product((False, True), repeat=n - 1):
        sizes, size = [], 1
        for cut in cuts:
            if cut:
                sizes.append(size)
                size = 1
            else:
                size += 1
        out.append([*sizes, size])
    return out


def detokenize(tokenizer: Any, ids: list[int], steps: list[int], params: SamplingParams,
               finish: FinishReason = FinishReason.LENGTH, logprobs: bool = False
               ) -> list[RequestOutput]:
    """The RequestOutputs of a sequence whose tokens `ids` arrive `steps` at a time, the
    last step ending it with `finish` (as the engine core would)."""
    op = OutputProcessor(tokenizer, request_tracing=False)
    [(child, _)] = op.add_request("r", None, [1, 2, 3], params)
    outs, pos = [], 0
    for k, size in enumerate(steps):
        new = ids[pos:pos + size]
        pos += size
        lps = None
        if logprobs:  # each token sampled with rank 1
            lps = LogprobsLists([[t] for t in new], [[-0.5] for _ in new], [1] * len(new))
        last = k == len(steps) - 1
        res, aborts = op.process_outputs([EngineCoreOutput(
            child, new, new_logprobs=lps, finish_reason=finish if last else None)])
        assert not aborts
        outs += [r for r in res if isinstance(r, RequestOutput)]
    return outs


# --- the detokenizer, without a server ----------------------------------------------------


def test_split_emoji_never_streams_a_replacement_character(tokenizer: Any) -> None:
    """Tokens that split a 4-byte character at every point the vocab allows, arriving in
    every grouping of steps: each step's text is a prefix of the final text (so a stream,
    which sends the difference, never sends U+FFFD and never takes anything back), and the
    character appears whole with the token that completes it."""
    a, b = (tokenizer(c, add_special_tokens=False).input_ids[0] for c in "ab")
    params = SamplingParams(max_tokens=16, logprobs=1)
    for split in emoji_splits(tokenizer):
        ids = [a, *split, b]
        for steps in compositions(len(ids)):
            outs = detokenize(tokenizer, ids, steps, params, logprobs=True)
            texts = [o.outputs[0].text for o in outs]
            assert texts[-1] == f"a{EMOJI}b", (split, steps, texts)
            assert all(REPLACEMENT not in t and texts[-1].startswith(t) for t in texts)
            ends = list(itertools.accumulate(steps))
            for t, end in zip(texts, ends):
                # a, then nothing until the emoji's last byte, then all of it
                complete = end >= len(ids) - 1
                assert t == ("a" + (EMOJI if complete else "") + ("b" if end == len(ids) else ""))
            # The logprobs name each token by what it adds: "" for the emoji's first bytes,
            # the whole emoji for its last; their concatenation is the text.
            names = [lp[t].decoded_token for lp, t in zip(outs[-1].outputs[0].logprobs, ids)]
            assert names == ["a", *[""] * (len(split) - 1), EMOJI, "b"], names
            assert outs[-1].outputs[0].token_ids == ids


def test_a_character_cut_by_max_tokens_is_left_out(tokenizer: Any) -> None:
    """max_tokens ends the sequence inside the emoji: its bytes never reach the text."""
    a = tokenizer("a", add_special_tokens=False).input_ids[0]
    for split in emoji_splits(tokenizer):
        for cut in range(1, len(split)):
            ids = [a, *split[:cut]]
            for steps in compositions(len(ids)):
                outs = detokenize(tokenizer, ids, steps, SamplingParams(max_tokens=len(ids)))
                assert [o.outputs[0].text for o in outs][-1] == "a"
                assert all(REPLACEMENT not in o.outputs[0].text for o in outs)


def test_prompt_logprob_names_complete_split_characters(tokenizer: Any) -> None:
    """Prompt logprobs name a token after the prompt tokens before it, as sampled ones do."""
    a = tokenizer("a", add_special_tokens=False).input_ids[0]
    split = emoji_splits(tokenizer)[1]  # one byte a token
    prompt = [a, *split, a]
    op = OutputProcessor(tokenizer, request_tracing=False)
    [(child, _)] = op.add_request("r", None, prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    rows = LogprobsLists([[t] for t in prompt[1:]], [[-1.0] for _ in prompt[1:]],
                         [1] * (len(prompt) - 1))
    [res], _ = op.process_outputs([EngineCoreOutput(child, [a], prompt_logprobs=rows,
                                                    finish_reason=FinishReason.LENGTH)])
    assert isinstance(res, RequestOutput) and res.prompt_logprobs is not None
    names = [None if e is None else e[t].decoded_token for e, t in zip(res.prompt_logprobs, prompt)]
    assert names == [None, "", "", "", EMOJI, "a"]


def test_the_stop_token_is_text_only_with_include_stop_str_in_output(tokenizer: Any) -> None:
    """vLLM's detokenizer leaves the token that stopped the sequence (EOS) out of the text
    unless include_stop_str_in_output; with skip_special_tokens false its text then ends
    the output, as the ids do."""
    ids = [*tokenizer("Hi", add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    for include, skip, tail in ((False, False, ""), (True, True, ""),
                                (True, False, tokenizer.eos_token)):
        params = SamplingParams(max_tokens=8, skip_special_tokens=skip,
                                include_stop_str_in_output=include)
        [out] = detokenize(tokenizer, ids, [len(ids)], params, finish=FinishReason.STOP)
        assert out.outputs[0].text == "Hi" + tail and out.outputs[0].token_ids == ids
        assert tokenizer.decode(ids).startswith(out.outputs[0].text)


def test_a_broken_decode_stream_starts_over(tokenizer: Any) -> None:
    """tokenizers' DecodeStream can fail with "Invalid prefix encountered" on a tokenizer
    whose decoding is not monotonic; the sequence goes on with a fresh stream (vLLM's)."""
    op = OutputProcessor(tokenizer, request_tracing=False)
    [(child, _)] = op.add_request("r", None, [1], SamplingParams(max_tokens=4))

    class Broken:
        def step(self, backend: Any, token: int) -> str | None:
            raise RuntimeError("Invalid prefix encountered while decoding stream")

    op.requests["r"].seqs[0].stream = Broken()  # type: ignore[assignment]
    a = tokenizer("a", add_special_tokens=False).input_ids[0]
    [res], _ = op.process_outputs([EngineCoreOutput(child, [a], finish_reason=FinishReason.LENGTH)])
    assert isinstance(res, RequestOutput) and res.outputs[0].text == "a"


# --- through the server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(agent_server: RemoteServer) -> RemoteServer:
    return agent_server


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


GREEDY: dict[str, Any] = dict(model=MODEL, temperature=0.0)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.slow
def test_echo_with_a_continued_message(client: openai.OpenAI) -> None:
    """vLLM's chat echo: the content starts with the final message it continued, streamed
    (a chunk of its own after the role) and not."""
    prefill = "The capital of France is"
    messages = [{"role": "user", "content": "Tell me about France."},
                {"role": "assistant", "content": prefill}]
    kw: dict[str, Any] = dict(messages=messages, max_tokens=4, **GREEDY)
    body = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(
        extra_body={**body, "echo": False}, **kw).choices[0].message.content
    echoed = client.chat.completions.create(extra_body=body, **kw).choices[0]
    assert echoed.message.role == "assistant" and echoed.message.content == prefill + plain
    chunks = list(client.chat.completions.create(stream=True, extra_body=body, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[1].content == prefill
    assert "".join(d.content or "" for d in deltas) == prefill + plain
    # Without echo, or when the last message is not the reply's role, nothing is prepended.
    asked = client.chat.completions.create(messages=messages[:1], max_tokens=4, extra_body={
        "echo": True}, **GREEDY).choices[0].message.content
    assert asked == client.chat.completions.create(
        messages=messages[:1], max_tokens=4, **GREEDY).choices[0].message.content


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_tool_call_cut_by_max_tokens(server: RemoteServer, client: openai.OpenAI,
                                              tool_choice: Any) -> None:
    """tool_choice forces a call and max_tokens cuts it: finish_reason "length", no
    tool_calls key (None, not [] and not half the JSON), as vLLM answers; streamed, every
    tool call delta carries an index and a function with string arguments, and the
    openai client's stream helper runs to the end."""
    kw: dict[str, Any] = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=4,
                              **GREEDY)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content in ("", None)
    raw = httpx.post(server.url("/v1/chat/completions"), json=kw, timeout=60).json()
    assert "tool_calls" not in raw["choices"][0]["message"]
    finishes = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finishes += [c.finish_reason] if c.finish_reason else []
            for tc in c.delta.tool_calls or ():
                assert isinstance(tc.index, int) and tc.function is not None
                assert isinstance(tc.function.arguments, str)
                if tc.id is not None:
                    assert tc.type == "function" and tc.function.name == "get_weather"
    assert finishes == ["length"]
    # The client's stream helper reads every event (its get_final_completion refuses any
    # "length" finish by design, whatever the server).
    with client.chat.completions.stream(**kw) as stream:
        events = [event.type for event in stream]
        snapshot = stream.current_completion_snapshot
    assert "chunk" in events and snapshot.choices[0].finish_reason == "length"
    # Uncut, the same call is whole.
    whole = client.chat.completions.create(**{**kw, "max_tokens": 60})
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)


def holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


@pytest.mark.slow
def test_split_emoji_generated(client: openai.OpenAI, tokenizer: Any) -> None:
    """The model writes the emoji with its bytes split over tokens at every point: two bytes
    then one and one (how the grammar spells a😀b), and one byte a token (copying a prompt
    that spells it so, only those tokens allowed). Streamed and not, no chunk's text and no
    logprob token holds U+FFFD, every chunk carries its token ids as a list, and the chunks'
    texts, ids and logprob tokens add up to the whole response's, whose logprob tokens add
    up to its ids' text."""
    a, b, space = (tokenizer(c, add_special_tokens=False).input_ids[0] for c in "ab ")
    head, single = emoji_splits(tokenizer)
    cases: list[tuple[dict[str, Any], dict[str, Any], list[int]]] = [
        (dict(prompt="Say it:", max_tokens=6), {"structured_outputs": {"regex": f"a{EMOJI}b"}},
         head),
        (dict(prompt=[a, *single, b, space] * 2, max_tokens=7),
         {"allowed_token_ids": [a, b, space, *single]}, single),
    ]
    for kw, extra, split in cases:
        kw, extra = {**kw, "logprobs": 1, **GREEDY}, {**extra, "return_token_ids": True}
        whole = client.completions.create(extra_body=extra, **kw).choices[0]
        assert EMOJI in whole.text and REPLACEMENT not in whole.text
        assert holds(whole.token_ids, split), whole.token_ids
        assert "".join(whole.logprobs.tokens) == tokenizer.decode(whole.token_ids)
        assert not any(REPLACEMENT in t for t in whole.logprobs.tokens)
        text, ids, names = "", [], []
        for chunk in client.completions.create(stream=True, extra_body=extra, **kw):
            for c in chunk.choices:
                assert REPLACEMENT not in c.text and isinstance(c.token_ids, list)
                text, ids, names = text + c.text, ids + c.token_ids, names + c.logprobs.tokens
        assert (text, ids, names) == (whole.text, whole.token_ids, whole.logprobs.tokens)
    # A chat stream holds the bytes back as well.
    content, chat_ids = "", []
    for chunk in client.chat.completions.create(
            messages=[{"role": "user", "content": "Say it."}], max_tokens=6, stream=True,
            extra_body={"structured_outputs": {"regex": f"a{EMOJI}b"}, "return_token_ids": True},
            **GREEDY):
        if chunk.choices:
            assert REPLACEMENT not in (chunk.choices[0].delta.content or "")
            content += chunk.choices[0].delta.content or ""
            chat_ids += chunk.choices[0].model_extra.get("token_ids") or []
    assert content == f"a{EMOJI}b" and holds(chat_ids, head)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_split_emoji_in_prompts(client: openai.OpenAI, tokenizer: Any, stream: bool) -> None:
    """Prompts whose tokens split the emoji at every point, echoed with their logprobs: the
    text is whole, and the prompt's logprob tokens name "" for the emoji's first pieces and
    the whole emoji for its last."""
    a, b = (tokenizer(c, add_special_tokens=False).input_ids[0] for c in "ab")
    for split in emoji_splits(tokenizer):
        prompt = [a, *split, b]
        kw: dict[str, Any] = dict(prompt=prompt, max_tokens=1, echo=True, logprobs=1, **GREEDY)
        if stream:
            text, names = "", []
            for chunk in client.completions.create(stream=True, **kw):
                text += chunk.choices[0].text
                names += chunk.choices[0].logprobs.tokens
        else:
            c = client.completions.create(**kw).choices[0]
            text, names = c.text, c.logprobs.tokens
        assert text.startswith(f"a{EMOJI}b") and REPLACEMENT not in text
        assert names[:len(prompt)] == ["a", *[""] * (len(split) - 1), EMOJI, "b"], names


@pytest.mark.slow
def test_streamed_token_ids_are_lists_and_add_up(server: RemoteServer, client: openai.OpenAI,
                                                 tokenizer: Any) -> None:
    """return_token_ids in a chat stream (vLLM's test_chat_completion_with_emoji_and_token_ids):
    the first chunk carries the prompt's ids and later ones have no prompt_token_ids key; a
    chunk that has a token_ids key has a list there; the ids add up to the content, with the
    EOS that ended it."""
    kw: dict[str, Any] = dict(messages=[{"role": "user", "content": "Say hello in one word."}],
                              max_tokens=24, **GREEDY)
    whole = client.chat.completions.create(extra_body={"return_token_ids": True}, **kw)
    content, ids, first = "", [], True
    for chunk in client.chat.completions.create(stream=True, extra_body={"return_token_ids": True},
                                                stream_options={"include_usage": True}, **kw):
        dump = chunk.model_dump()
        if first:
            assert chunk.prompt_token_ids == whole.prompt_token_ids
            first = False
        else:
            assert "prompt_token_ids" not in dump
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            if "token_ids" in chunk.choices[0].model_dump():
                assert isinstance(chunk.choices[0].token_ids, list)
                ids += chunk.choices[0].token_ids
    assert content == whole.choices[0].message.content and ids == whole.choices[0].token_ids
    eos = tokenizer.eos_token if whole.choices[0].finish_reason == "stop" else ""
    assert tokenizer.decode(ids) == content + eos
    # skip_special_tokens false: the ids' special tokens are in the text; the EOS that ended
    # it with include_stop_str_in_output too (vLLM leaves it out otherwise).
    special = client.chat.completions.create(extra_body={
        "return_token_ids": True, "skip_special_tokens": False,
        "include_stop_str_in_output": True}, **kw).choices[0]
    assert special.message.content == tokenizer.decode(special.token_ids)
    if special.finish_reason == "stop":
        assert special.message.content.endswith(tokenizer.eos_token)


@pytest.mark.slow
def test_tokens_as_token_ids_match_token_ids(client: openai.OpenAI) -> None:
    """return_tokens_as_token_ids names the sampled tokens `token_id:N`, in order, the same
    ids as token_ids: completions (echoed, streamed) and chat (streamed and not)."""
    kw: dict[str, Any] = dict(max_tokens=6, logprobs=1, **GREEDY)
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True, "prompt_logprobs": 1}
    c = client.completions.create(prompt="Hello, world!", echo=True, extra_body=extra, **kw).choices[0]
    named = [int(t.removeprefix("token_id:")) for t in c.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in c.logprobs.tokens)
    assert named == [*c.prompt_token_ids, *c.token_ids]
    ids, names = [], []
    for chunk in client.completions.create(prompt="Tell me a fact about Python:", stream=True,
                                           extra_body={"return_token_ids": True, "ignore_eos": True,
                                                       "return_tokens_as_token_ids": True}, **kw):
        ids += chunk.choices[0].token_ids
        names += chunk.choices[0].logprobs.tokens
        assert all(k.startswith("token_id:") for top in chunk.choices[0].logprobs.top_logprobs
                   for k in top)
    assert names == [f"token_id:{t}" for t in ids] and len(ids) == 6
    chat_kw: dict[str, Any] = dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                   logprobs=True, top_logprobs=1, **GREEDY)
    chat_extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    whole = client.chat.completions.create(extra_body=chat_extra, **chat_kw).choices[0]
    assert [e.token for e in whole.logprobs.content] == [f"token_id:{t}" for t in whole.token_ids]
    ids, names = [], []
    for chunk in client.chat.completions.create(stream=True, extra_body=chat_extra, **chat_kw):
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
            names += [e.token for e in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs
                                        else None) or ()]
    assert ids == whole.token_ids and names == [f"token_id:{t}" for t in ids]


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 3])
def test_chat_prompt_logprobs_count(client: openai.OpenAI, n: int) -> None:
    """Chat prompt_logprobs N: at every prompt position the prompt's own token plus the top N
    (vLLM's count: N entries when the prompt's token is among them, else N + 1), the first
    position None."""
    r = client.chat.completions.create(messages=[{"role": "user", "content": "Hi there, friend"}],
                                       max_tokens=1, extra_body={"prompt_logprobs": n,
                                                                 "return_token_ids": True},
                                       **GREEDY)
    plp = r.prompt_logprobs
    assert plp[0] is None and len(plp) == len(r.prompt_token_ids) == r.usage.prompt_tokens
    for pos, (entry, token) in enumerate(zip(plp[1:], r.prompt_token_ids[1:]), start=1):
        rank = entry[str(token)]["rank"]
        assert len(entry) == (n if rank <= n else n + 1), (pos, entry)
        # The top N are ranks 1..N; the prompt's token joins them when it ranks lower.
        others = sorted(v["rank"] for k, v in entry.items() if k != str(token))
        assert others == [r for r in range(1, n + 1) if r != rank], (pos, entry)


@pytest.mark.slow
@pytest.mark.parametrize("usage", [False, True])
def test_completion_stream_ends_with_length(client: openai.OpenAI, usage: bool) -> None:
    """A completion stream that max_tokens ends: one finish_reason, "length", on the last
    choice chunk, which carries text; the texts add up to the unstreamed completion (vLLM's
    test_completion_streaming). A stream the model ends first (EOS within max_tokens, as this
    model does for vLLM's own prompt) says "stop", as the unstreamed completion does."""
    opts = {"stream_options": {"include_usage": True}} if usage else {}
    for prompt, finish in (("Once upon a time", "length"), ("What is an LLM?", None)):
        kw: dict[str, Any] = dict(prompt=prompt, max_tokens=5, **GREEDY)
        whole = client.completions.create(**kw).choices[0]
        assert finish in (None, whole.finish_reason), whole
        chunks = list(client.completions.create(stream=True, **opts, **kw))
        choices = [c.choices[0] for c in chunks if c.choices]
        assert [c.finish_reason for c in choices if c.finish_reason] == [whole.finish_reason]
        assert choices[-1].finish_reason == whole.finish_reason
        assert "".join(c.text for c in choices) == whole.text
        if whole.finish_reason == "length":
            assert choices[-1].text
        if usage:
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 5
