"""Tool-call and reasoning parsers: whole replies, and streams (every prefix fed in turn) that
must add up to the whole reply; and GPT-OSS's harmony replies through the chat serving path, with
a scripted engine behind a tiny tokenizer."""

from __future__ import annotations

import argparse
import itertools
import json
import re
from types import SimpleNamespace

import pytest

from jaxserve.api_server.chat_output import ChatOutputParser, ToolMode
from jaxserve.api_server.reasoning_parsers import REASONING_PARSERS
from jaxserve.api_server.serving_chat import response_message
from jaxserve.api_server.tool_parsers import TOOL_PARSERS


def auto(parser: str) -> ToolMode:
    return ToolMode("auto", parser=TOOL_PARSERS[parser])


def streamed(mode: ToolMode, text: str, reasoning: str | None = None, step: int = 1,
             ends: list[int] | None = None) -> dict:
    """Feed every `step`-th prefix of `text` (or those ending at `ends`), then the whole; add
    the deltas up."""
    p = ChatOutputParser(mode, REASONING_PARSERS[reasoning] if reasoning else None)
    out: dict = {"reasoning": "", "content": "", "calls": []}
    if ends is None:
        ends = list(range(step, len(text), step)) + [len(text)]
    for end in ends:
        d = p.delta(text[:end], finished=end == len(text))
        out["reasoning"] += d.reasoning
        out["content"] += d.content
        for c in d.tool_calls:
            if c.id is not None:
                assert c.index == len(out["calls"]) and c.type == "function"
                out["calls"].append({"id": c.id, "name": c.function.name, "arguments": ""})
            out["calls"][c.index]["arguments"] += c.function.arguments or ""
    return out


def whole(mode: ToolMode, text: str, reasoning: str | None = None) -> dict:
    m = response_message(ChatOutputParser(mode, REASONING_PARSERS[reasoning] if reasoning else None),
                         text)
    return {"reasoning": m.reasoning, "content": m.content,
            "calls": [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls]}


def check_stream_matches(mode: ToolMode, text: str, reasoning: str | None = None) -> dict:
    w = whole(mode, text, reasoning)
    for step in (1, 3, 7):
        s = streamed(mode, text, reasoning, step)
        assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"]] == w["calls"]
        assert s["content"] == (w["content"] or "")
        assert s["reasoning"] == (w["reasoning"] or "")
    return w


WEATHER = {"city": "Paris", "unit": "celsius"}


def test_hermes_calls_and_content() -> None:
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
    w = check_stream_matches(auto("hermes"), text)
    assert w["content"] == "Let me check."
    assert w["calls"] == [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]
    p = ChatOutputParser(auto("hermes"))
    p.delta(text, True)
    assert p.finish_reason("stop") == "tool_calls" and p.finish_reason("length") == "length"


def test_hermes_plain_reply_and_partial_marker() -> None:
    text = "The answer is <b>42</b>, no tools <tool needed."
    w = check_stream_matches(auto("hermes"), text)
    assert w == {"reasoning": None, "content": text, "calls": []}
    # A half-written marker is held back until it is settled.
    p = ChatOutputParser(auto("hermes"))
    assert p.delta("Hi <tool_c", False).content == "Hi "
    assert p.delta("Hi <tool_cx", False).content == "<tool_cx"


def test_arguments_stream_as_they_arrive() -> None:
    p = ChatOutputParser(auto("hermes"))
    d = p.delta('<tool_call>{"name": "get_weather", "arguments": {"ci', False)
    assert d.tool_calls[0].function.name == "get_weather"
    assert d.tool_calls[0].function.arguments == '{"ci'
    d = p.delta('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>', True)
    assert d.tool_calls[0].id is None and d.tool_calls[0].function.arguments == 'ty": "Rome"}'


def test_llama3_json() -> None:
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
            '"celsius"}}; {"name": "get_time", "parameters": {}}')
    w = check_stream_matches(auto("llama3_json"), text)
    assert w["calls"] == [("get_weather", WEATHER), ("get_time", {})] and w["content"] is None
    w = check_stream_matches(auto("llama3_json"), ' {"name": "f", "parameters": {"x": 1}}')
    assert w["calls"] == [("f", {"x": 1})]
    # Text, or something that only looks like a call, stays content.
    assert check_stream_matches(auto("llama3_json"), "Sure: {a}")["content"] == "Sure: {a}"
    w = check_stream_matches(auto("llama3_json"), '{"not": "a call"}')
    assert w == {"reasoning": None, "content": '{"not": "a call"}', "calls": []}


def test_mistral() -> None:
    text = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}, {"arguments": {"tz": "CET"}, "name": "get_time"}]')
    w = check_stream_matches(auto("mistral"), text)
    # The second call names itself last: it is sent whole once complete.
    assert w["calls"] == [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]


def test_required_and_named() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]'
    w = check_stream_matches(ToolMode("required"), text)
    assert w["calls"] == [("get_weather", WEATHER)] and w["content"] is None
    w = check_stream_matches(ToolMode("named", "get_weather"), json.dumps(WEATHER))
    assert w["calls"] == [("get_weather", WEATHER)] and w["content"] is None
    p = ChatOutputParser(ToolMode("named", "get_weather"))
    p.delta(json.dumps(WEATHER), True)
    assert p.finish_reason("stop") == "stop"  # OpenAI's for a forced function


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    mode = ToolMode("auto", parallel=False, parser=TOOL_PARSERS["hermes"])
    assert whole(mode, text)["calls"] == [("a", {})]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_reasoning(parser: str) -> None:
    w = check_stream_matches(ToolMode(), "<think>\n2+2 is 4.\n</think>\n\nIt is 4.", parser)
    assert w["reasoning"] == "\n2+2 is 4.\n" and w["content"] == "It is 4."
    # No <think> at all: DeepSeek-R1's template opened it in the prompt; Qwen3 is not thinking.
    w = check_stream_matches(ToolMode(), "2+2 is 4.</think>It is 4.", parser)
    if parser == "deepseek_r1":
        assert (w["reasoning"], w["content"]) == ("2+2 is 4.", "It is 4.")
    else:
        assert (w["reasoning"], w["content"]) == (None, "2+2 is 4.</think>It is 4.")
    # Cut off while thinking: all reasoning.
    assert check_stream_matches(ToolMode(), "<think>hmm, let me", parser)["reasoning"] == "hmm, let me"


def test_reasoning_then_tool_call() -> None:
    text = '<think>I need the weather.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    w = check_stream_matches(auto("hermes"), text, "qwen3")
    assert w["reasoning"] == "I need the weather." and w["calls"] == [("get_weather", WEATHER)]


def test_cut_off_or_malformed_calls_read_the_same_streamed_and_whole() -> None:
    for mode, text in ((auto("hermes"), '<tool_call>\n{"name": "f", "arguments": {"city": "Par'),
                       (auto("hermes"), '<tool_call>{"name": "f", "arguments": {"a": 1.5e}}</tool_call>'),
                       (ToolMode("required"), '[{"name": "get_weather", "parameters": {"city": "Pa')):
        m = response_message(ChatOutputParser(mode), text)
        whole_calls = [(c.function.name, c.function.arguments) for c in m.tool_calls]
        assert whole_calls and m.content is None
        for step in (1, 4):
            s = streamed(mode, text, step=step)
            assert [(c["name"], c["arguments"]) for c in s["calls"]] == whole_calls
            assert s["content"] == ""
    # Nothing with a name: content, both ways.
    text = '<tool_call>{"nam'
    assert response_message(ChatOutputParser(auto("hermes")), text).content == text
    assert streamed(auto("hermes"), text)["content"] == text


# GPT-OSS's harmony format (openai_gptoss): the reply as decoded with its special tokens kept.
HARMONY_MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                   "<|return|>", "<|call|>", "<|endoftext|>")
THINK = "<|channel|>analysis<|message|>We need to add 2 and 2.<|end|>"
ANSWER = "<|start|>assistant<|channel|>final<|message|>The answer is 4."
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris"}')


def harmony_tokens(text: str) -> list[str]:
    """`text` cut as a tokenizer would: each marker whole, other text two characters a piece."""
    return re.findall("|".join(map(re.escape, HARMONY_MARKERS)) + "|.{1,2}", text, re.S)


def check_harmony(text: str, reasoning: str | None, content: str) -> None:
    """The whole reply splits as expected; fed character by character or token by token, the
    parts only grow, never show a marker or part of one, and end as the whole reply's."""
    split = REASONING_PARSERS["openai_gptoss"]().split(text, finished=True)
    assert (split.reasoning, split.content) == (reasoning, content)
    for pieces in (list(text), harmony_tokens(text)):
        parser, seen, prev = REASONING_PARSERS["openai_gptoss"](), "", None
        for i, piece in enumerate(pieces):
            seen += piece
            s = parser.split(seen, finished=i == len(pieces) - 1)
            # A leaked marker, or part of one held back too late, is no prefix of the end.
            assert (reasoning or "").startswith(s.reasoning or "") and content.startswith(s.content)
            assert not any(m in (s.reasoning or "") + s.content for m in HARMONY_MARKERS)
            if prev is not None:
                assert (s.reasoning or "").startswith(prev.reasoning or ""), (seen, prev, s)
                assert s.content.startswith(prev.content), (seen, prev, s)
                assert prev.reasoning is None or s.reasoning is not None
            prev = s
        assert prev == split
    w = check_stream_matches(ToolMode(), text, "openai_gptoss")
    assert (w["reasoning"], w["content"]) == (reasoning, content)


@pytest.mark.parametrize("end", ["", "<|return|>"])  # the EOS is not text, unless kept
def test_gptoss_analysis_then_final(end: str) -> None:
    check_harmony(THINK + ANSWER + end, "We need to add 2 and 2.", "The answer is 4.")
    check_harmony("<|channel|>final<|message|>4" + end, None, "4")


@pytest.mark.parametrize("end", ["", "<|call|>"])
def test_gptoss_tool_calls_are_in_neither_part(end: str) -> None:
    preamble = "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
    check_harmony(THINK + preamble + CALL + end, "We need to add 2 and 2.", "Let me check.")
    # The recipient may be in the role's header too, which the prompt opened.
    check_harmony(' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
                  + end, None, "")
    check_harmony(THINK + "<|start|>assistant to=python<|channel|>analysis<|message|>print(4)"
                  + end, "We need to add 2 and 2.", "")


def test_gptoss_cut_off_and_malformed_replies() -> None:
    # Cut off while thinking, or in the next header: what was thought is reasoning.
    check_harmony("<|channel|>analysis<|message|>hmm, let me", "hmm, let me", "")
    check_harmony(THINK + "<|start|>assistant<|channel|>fin", "We need to add 2 and 2.", "")
    check_harmony("<|channel|>analysis<|mess", None, "")
    # No <|end|> before the next message; several messages of a kind; a stray <|constrain|>.
    check_harmony("<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b",
                  "a", "b")
    check_harmony(THINK + THINK.replace("add", "sum") + ANSWER + "<|end|>" + ANSWER,
                  "We need to add 2 and 2.\nWe need to sum 2 and 2.",
                  "The answer is 4.\nThe answer is 4.")
    check_harmony("<|channel|>final<|message|>x<|constrain|>y", None, "xy")
    # A model that did not follow the format: all content, look-alikes included.
    for text in ("The answer is <b>4</b> <| not a marker", "to=me, it is 4", "  "):
        check_harmony(text, None, text)
    check_harmony("Sure.<|channel|>final<|message|>4", None, "Sure.\n4")


# A tiny character-level tokenizer holding harmony's markers as special tokens, with a
# harmony-style chat template (the prompt ends with <|start|>assistant, as GPT-OSS's does).
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}"
                    "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def harmony_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{chr(c): c - 31 for c in range(32, 127)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|return|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=list(HARMONY_MARKERS))
    fast.chat_template = HARMONY_TEMPLATE
    return fast


class ScriptedClient:
    """The engine's stand-in: it 'generates' `reply`'s token ids, one a step, and the real
    OutputProcessor detokenizes them with the request's params."""

    def __init__(self, tokenizer, reply: str) -> None:
        from jaxserve.engine.output_processor import OutputProcessor

        self.output_processor = OutputProcessor(tokenizer, request_tracing=False)
        self.reply_ids = tokenizer(reply, add_special_tokens=False).input_ids
        self.params: list = []

    async def generate(self, request_id, prompt, prompt_token_ids, params, **kwargs):
        from jaxserve.engine_core.core_outputs import EngineCoreOutput
        from jaxserve.outputs import FinishReason

        self.params.append(params)
        [(child, _)] = self.output_processor.add_request(request_id, prompt, prompt_token_ids,
                                                         params)
        for i, tok in enumerate(self.reply_ids):
            last = i == len(self.reply_ids) - 1
            outs, _ = self.output_processor.process_outputs([EngineCoreOutput(
                child, [tok], finish_reason=FinishReason.STOP if last else None)])
            yield outs[0]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def serve_chat(parser: str | None, reply: str, stream: bool, tool_parser: str | None = None,
               tools: list | None = None) -> tuple[ScriptedClient, list[int], object]:
    """One chat completion through the chat serving path: (client, prompt ids, the reply's
    JSON or its stream's chunks)."""
    import asyncio

    from jaxserve.api_server.protocol import ChatCompletionRequest
    from jaxserve.api_server.serving import ServingContext
    from jaxserve.api_server.serving_chat import OpenAIServingChat
    from jaxserve.engine.processor import Processor

    tok = harmony_tokenizer()
    client = ScriptedClient(tok, reply)
    eos = frozenset(tok.convert_tokens_to_ids(["<|return|>", "<|call|>"]))
    ctx = ServingContext(client, tok, ["gpt-oss-tiny"],
                         Processor(max_model_len=512, vocab_size=len(tok), model_eos_token_ids=eos),
                         reasoning_parser=parser, tool_call_parser=tool_parser,
                         enable_auto_tool_choice=tool_parser is not None)
    request = ChatCompletionRequest.model_validate({
        "model": "gpt-oss-tiny", "messages": [{"role": "user", "content": "2+2?"}],
        "stream": stream, "max_tokens": 200, **({"tools": tools} if tools else {})})

    async def run() -> tuple[list[int], object]:
        prompt_ids = (await OpenAIServingChat(ctx).render_prompt(request))[1]
        resp = await OpenAIServingChat(ctx).create_chat_completion(request)
        if not stream:
            return prompt_ids, json.loads(resp.body)
        frames = [f async for f in resp.body_iterator]
        return prompt_ids, [json.loads(f[len("data: "):]) for f in frames
                            if f.startswith("data: {")]

    try:
        return client, *asyncio.run(run())
    finally:
        ctx.executor.shutdown()


def test_gptoss_chat_completion_keeps_special_tokens_and_splits() -> None:
    reply = THINK + ANSWER + "<|return|>"
    client, prompt_ids, body = serve_chat("openai_gptoss", reply, stream=False)
    tok = harmony_tokenizer()
    # The template's markers are single special tokens of the prompt.
    assert prompt_ids == tok("<|start|>user<|message|>2+2?<|end|><|start|>assistant",
                             add_special_tokens=False).input_ids
    assert tok.convert_tokens_to_ids("<|start|>") in prompt_ids
    assert len(prompt_ids) == len("user2+2?assistant") + 4
    assert [p.skip_special_tokens for p in client.params] == [False]
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "We need to add 2 and 2."
    assert msg["content"] == "The answer is 4."
    assert body["choices"][0]["finish_reason"] == "stop"

    client, _, chunks = serve_chat("openai_gptoss", reply, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "We need to add 2 and 2."
    assert "".join(d.get("content") or "" for d in deltas) == "The answer is 4."
    assert not any("<|" in (d.get("content") or "") + (d.get("reasoning") or "") for d in deltas)

    # Other parsers leave the request's skip_special_tokens (default True): the markers go.
    client, _, body = serve_chat("qwen3", reply, stream=False)
    assert [p.skip_special_tokens for p in client.params] == [True]
    assert body["choices"][0]["message"]["content"] == (
        "analysisWe need to add 2 and 2.assistantfinalThe answer is 4.")



# --tool-call-parser openai: harmony messages addressed to functions.NAME are tool calls.
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
CALL_TIME = ('<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json'
             '<|message|>{"tz":"CET"}')
BROWSER = ('<|start|>assistant<|channel|>analysis to=browser.search <|constrain|>json'
           '<|message|>{"query": "weather Paris"}<|call|>')
PYTHON = "<|start|>assistant<|channel|>analysis to=python code<|message|>print(2 + 2)<|call|>"


def openai_mode(parallel: bool = True) -> ToolMode:
    return ToolMode("auto", parallel=parallel, parser=TOOL_PARSERS["openai"])


def check_harmony_calls(text: str, reasoning: str | None = "openai_gptoss",
                        parallel: bool = True) -> dict:
    """The whole reply's message; fed character by character and token by token (each marker
    whole), the deltas add up to it: each call's id and name once, then its arguments, which
    never hold a marker or part of one."""
    mode = openai_mode(parallel)
    m = response_message(ChatOutputParser(mode, REASONING_PARSERS[reasoning] if reasoning else None),
                         text)
    w = {"reasoning": m.reasoning, "content": m.content,
         "calls": [(c.function.name, c.function.arguments) for c in m.tool_calls]}
    token_ends = list(itertools.accumulate(map(len, harmony_tokens(text))))
    for ends in (list(range(1, len(text) + 1)), token_ends):
        s = streamed(mode, text, reasoning, ends=ends)
        assert [(c["name"], c["arguments"]) for c in s["calls"]] == w["calls"]
        assert s["content"] == (w["content"] or "") and s["reasoning"] == (w["reasoning"] or "")
    assert not any(marker in args for _, args in w["calls"] for marker in HARMONY_MARKERS)
    p = ChatOutputParser(mode, REASONING_PARSERS[reasoning] if reasoning else None)
    p.delta(text, True)
    assert p.finish_reason("stop") == ("tool_calls" if w["calls"] else "stop")
    return w


@pytest.mark.parametrize("end", ["", "<|call|>"])  # <|call|> is an EOS: text only if kept
def test_openai_tool_parser_one_and_two_calls(end: str) -> None:
    w = check_harmony_calls(CALL + end)
    assert w == {"reasoning": None, "content": None,
                 "calls": [("get_weather", '{"city": "Paris"}')]}
    w = check_harmony_calls(CALL + "<|call|>" + CALL_TIME + end)
    assert w["calls"] == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz":"CET"}')]
    assert w["content"] is None
    # parallel_tool_calls false keeps the first.
    w = check_harmony_calls(CALL + "<|call|>" + CALL_TIME + end, parallel=False)
    assert w["calls"] == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("end", ["", "<|call|>"])
def test_openai_tool_parser_after_reasoning_and_a_preamble(end: str) -> None:
    w = check_harmony_calls(THINK + PREAMBLE + CALL + end)
    assert w == {"reasoning": "We need to add 2 and 2.", "content": "Let me check.",
                 "calls": [("get_weather", '{"city": "Paris"}')]}
    # The recipient in the role's header (which the prompt opened), a bare content type.
    w = check_harmony_calls(' to=functions.get_weather<|channel|>commentary json<|message|>'
                            '{"city": "Paris"}' + end)
    assert w == {"reasoning": None, "content": None,
                 "calls": [("get_weather", '{"city": "Paris"}')]}
    w = check_harmony_calls(THINK + '<|start|>assistant to=functions.get_time<|channel|>commentary '
                            '<|constrain|>json<|message|>{}' + end)
    assert w["calls"] == [("get_time", "{}")] and w["reasoning"] == "We need to add 2 and 2."


def test_openai_tool_parser_leaves_built_in_tools_out() -> None:
    # browser.* and python are GPT-OSS's built-in tools, which jaxserve does not run: neither
    # calls nor content, and the reply finishes as "stop".
    for builtin in (BROWSER, PYTHON):
        w = check_harmony_calls(THINK + builtin)
        assert w == {"reasoning": "We need to add 2 and 2.", "content": "", "calls": []}
    w = check_harmony_calls(THINK + BROWSER + PREAMBLE + CALL + "<|call|>")
    assert w["calls"] == [("get_weather", '{"city": "Paris"}')] and w["content"] == "Let me check."
    # A final answer after a call is content.
    w = check_harmony_calls(CALL + "<|call|>" + ANSWER + "<|return|>")
    assert w["content"] == "The answer is 4." and len(w["calls"]) == 1


def test_openai_tool_parser_cut_off_calls() -> None:
    # Cut off in the arguments: the call keeps what was written, streamed and whole alike.
    w = check_harmony_calls(THINK + CALL[:-4])
    assert w == {"reasoning": "We need to add 2 and 2.", "content": None,
                 "calls": [("get_weather", '{"city": "Par')]}
    # Cut off in the header (the name may be half-written, or the header may be a built-in's):
    # no call, and nothing of it leaks.
    for cut in ("<|start|>assistant<|channel|>commentary to=functions.get_wea",
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>js",
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|mess"):
        assert check_harmony_calls(THINK + cut) == {
            "reasoning": "We need to add 2 and 2.", "content": "", "calls": []}
    # A recipient with no function name is no call.
    assert check_harmony_calls("<|channel|>commentary to=functions. json<|message|>{}")["calls"] == []


def test_openai_tool_parser_without_a_reasoning_parser_object() -> None:
    # The calls read the same; the content is what no reasoning parser leaves (the serving
    # brings openai_gptoss, below).
    w = check_harmony_calls(CALL + "<|call|>", reasoning=None)
    assert w["calls"] == [("get_weather", '{"city": "Paris"}')]


def test_openai_tool_calls_through_chat_completions() -> None:
    reasoning_parser = "openai_gptoss"  # given, or implied by --tool-call-parser openai (below)
    reply = THINK + PREAMBLE + CALL + "<|call|>"
    client, _, body = serve_chat(reasoning_parser, reply, stream=False, tool_parser="openai",
                                 tools=[WEATHER_TOOL])
    assert [p.skip_special_tokens for p in client.params] == [False]
    choice = body["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert msg["reasoning_content"] == msg["reasoning"] == "We need to add 2 and 2."
    assert msg["content"] == "Let me check."
    [call] = msg["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    client, _, chunks = serve_chat(reasoning_parser, reply, stream=True, tool_parser="openai",
                                   tools=[WEATHER_TOOL])
    assert [p.skip_special_tokens for p in client.params] == [False]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    deltas = [c["delta"] for c in choices]
    calls: list[dict] = []
    for d in deltas:
        for tc in d.get("tool_calls") or ():
            if tc.get("id"):
                assert tc["index"] == len(calls) and tc["function"]["name"]
                calls.append({"id": tc["id"], "type": tc["type"],
                              "function": {"name": tc["function"]["name"], "arguments": ""}})
            else:
                assert not tc["function"].get("name")
            calls[tc["index"]]["function"]["arguments"] += tc["function"].get("arguments") or ""
    assert sum(1 for d in deltas if d.get("tool_calls")) > 2  # the arguments arrive in pieces
    assert [c["function"] for c in calls] == [c["function"] for c in msg["tool_calls"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["tool_calls"]

    # A reply that calls no tool finishes as "stop" with its answer as content.
    _, _, body = serve_chat(reasoning_parser, THINK + ANSWER + "<|return|>", stream=False,
                            tool_parser="openai", tools=[WEATHER_TOOL])
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == "The answer is 4."
    assert body["choices"][0]["message"]["tool_calls"] == []


def test_openai_tool_parser_brings_its_reasoning_parser_and_refuses_another() -> None:
    from jaxserve.api_server.server_args import ServerArgs

    config = SimpleNamespace(model_config=SimpleNamespace(skip_tokenizer_init=False),
                             request_tracing=True)

    def parse(*argv: str) -> ServerArgs:
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        return ServerArgs.from_cli_args(parser.parse_args(argv), config)

    # Without --reasoning-parser, `openai` brings openai_gptoss, decided at start-up: every
    # reply is split, a request without tools too (as vLLM splits every GPT-OSS reply).
    for reasoning in ([], ["--reasoning-parser", "openai_gptoss"]):
        args = parse("--enable-auto-tool-choice", "--tool-call-parser", "openai", *reasoning)
        assert (args.tool_call_parser, args.reasoning_parser) == ("openai", "openai_gptoss")
    client, _, body = serve_chat(args.reasoning_parser, THINK + ANSWER + "<|return|>",
                                 stream=False, tool_parser="openai")
    assert [p.skip_special_tokens for p in client.params] == [False]
    msg = body["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("We need to add 2 and 2.", "The answer is 4.")
    with pytest.raises(ValueError, match="--reasoning-parser openai_gptoss"):
        parse("--tool-call-parser", "openai", "--reasoning-parser", "qwen3")
