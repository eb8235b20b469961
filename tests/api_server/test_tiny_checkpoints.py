"""Tiny random checkpoints through the server: a Gemma 3 with Gemma's chat template, special
tokens and two EOS ids (generation_config.json's <eos> and <end_of_turn>); and a Qwen3-MoE
folder without tokenizer files under --skip-tokenizer-init, serving token ids (vLLM's
`return_token_ids`) with transformers' greedy tokens, and refusing text with a 400."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from tests.models.test_gemma import hf_greedy, tiny_gemma
from tests.models.tiny import save_tiny_hf

from .server_utils import EAGER, RemoteServer

TINY_ARGS = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
             "--block-size", "8", "--kv-cache-memory-bytes", str(8 << 20), *EAGER]

# Gemma's own template (Gemma 2's, which Gemma 3's keeps for text): <bos>, turns marked with
# <start_of_turn>role\n ... <end_of_turn>\n, "model" for the assistant, no system role.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
    "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user')"
    " != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
START_OF_TURN, END_OF_TURN, EOS, BOS = 105, 106, 1, 2  # Gemma's ids


def save_gemma_tokenizer(model_dir: str) -> None:
    """A character-level fast tokenizer with Gemma's special tokens at Gemma's ids, its chat
    template, and Gemma 3's generation_config.json (EOS = <eos> and <end_of_turn>)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["\n", " ", *map(chr, range(ord("a"), ord("z") + 1)),
             *map(chr, range(ord("A"), ord("Z") + 1)), *".,!?'"]
    vocab = {"<pad>": 0, "<eos>": EOS, "<bos>": BOS, "<unk>": 3,
             **{c: 4 + i for i, c in enumerate(chars)}}
    specials = {START_OF_TURN: "<start_of_turn>", END_OF_TURN: "<end_of_turn>"}
    for i in range(len(vocab), 128):
        vocab[specials.get(i, f"<unused{i}>")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>",
                                   additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    fast.chat_template = GEMMA_TEMPLATE
    fast.save_pretrained(model_dir)
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS, "eos_token_id": [EOS, END_OF_TURN], "pad_token_id": 0}, f)


def hf_argmax_tokens(model_dir: str, prompt: list[int], n: int) -> list[int]:
    """transformers' most likely next token, `n` times, nothing suppressed (no EOS rule)."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    model_dir = tiny_gemma("gemma3", str(tmp_path_factory.mktemp("gemma")))
    save_gemma_tokenizer(model_dir)
    with RemoteServer([model_dir, *TINY_ARGS, "--served-model-name", "tiny-gemma"]) as s:
        yield s, model_dir


def test_gemma_chat_template_and_both_eos_ids(gemma) -> None:
    from transformers import AutoTokenizer

    server, model_dir = gemma
    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "Hi there"}]
    rendered = "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
    want_ids = tok(rendered, add_special_tokens=False).input_ids
    assert want_ids[:2] == [BOS, START_OF_TURN] and END_OF_TURN in want_ids
    got = httpx.post(server.url("/tokenize"), json={"messages": messages}).json()["tokens"]
    assert got == want_ids
    client = server.client()
    r = client.chat.completions.create(model="tiny-gemma", messages=messages, max_tokens=12,
                                       temperature=0, extra_body={"return_token_ids": True})
    ids = r.choices[0].token_ids
    assert r.prompt_token_ids == want_ids and r.usage.prompt_tokens == len(want_ids)
    # transformers' argmax tokens, up to and including the first of either EOS id.
    ref = hf_argmax_tokens(model_dir, want_ids, 12)
    cut = next((i + 1 for i, t in enumerate(ref) if t in (EOS, END_OF_TURN)), len(ref))
    assert ids == ref[:cut]
    assert r.choices[0].finish_reason == ("stop" if ref[cut - 1] in (EOS, END_OF_TURN) else "length")
    assert r.choices[0].message.content == tok.decode(ids, skip_special_tokens=True)
    # Each EOS id ends the reply: <end_of_turn> (generation_config.json) as <eos> does.
    for eos in (END_OF_TURN, EOS):
        r = client.chat.completions.create(model="tiny-gemma", messages=messages, max_tokens=5,
                                           logit_bias={str(eos): 100},
                                           extra_body={"return_token_ids": True})
        c = r.choices[0]
        assert (c.finish_reason, c.message.content, c.token_ids) == ("stop", "", [eos]), eos
    # The template's own refusal (no system role) is the request's fault.
    with pytest.raises(openai.BadRequestError, match="System role not supported"):
        client.chat.completions.create(model="tiny-gemma", max_tokens=2, messages=[
            {"role": "system", "content": "Be brief."}, *messages])


PROMPTS = [[5, 17, 42, 99, 3, 8], [11], [(7 * i) % 120 + 1 for i in range(30)]]


@pytest.fixture(scope="module")
def token_ids_only(tmp_path_factory):
    model_dir = save_tiny_hf("qwen3_moe", str(tmp_path_factory.mktemp("moe")))
    assert not any(f.startswith("tokenizer") for f in os.listdir(model_dir))
    with RemoteServer([model_dir, *TINY_ARGS, "--skip-tokenizer-init"]) as s:
        yield s, model_dir


def test_skip_tokenizer_init_serves_token_ids(token_ids_only) -> None:
    server, model_dir = token_ids_only
    model = os.path.basename(model_dir)
    ref = hf_greedy(model_dir, PROMPTS, 16)
    client = server.client()
    r = client.completions.create(model=model, prompt=PROMPTS, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.token_ids for c in r.choices] == ref
    assert [c.prompt_token_ids for c in r.choices] == PROMPTS
    assert all(c.text == "" for c in r.choices) and r.usage.completion_tokens == 48
    # Streamed: the prompt's ids in the first chunk, then each chunk's new ids.
    streamed, prompt_ids = [], []
    for chunk in client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=16,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True,
                                                       "return_token_ids": True}):
        for c in chunk.choices:
            streamed += c.token_ids or []
            prompt_ids += c.prompt_token_ids or []
    assert streamed == ref[2] and prompt_ids == PROMPTS[2]
    # Without return_token_ids the ids stay out of the body, as in vLLM.
    plain = httpx.post(server.url("/v1/completions"),
                       json={"prompt": PROMPTS[1], "max_tokens": 2}).json()
    assert plain["choices"][0]["token_ids"] is None
    # Embeddings of token ids need no tokenizer either.
    e = client.embeddings.create(model=model, input=[PROMPTS[0]], encoding_format="float")
    assert len(e.data[0].embedding) == 64


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hello"}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "stop": ["x"]}, "stop"),
    ("/v1/completions", {"prompt": [1, 2], "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/v1/embeddings", {"input": "hello"}, "input"),
    ("/tokenize", {"prompt": "hello"}, "prompt"),
    ("/detokenize", {"tokens": [1, 2]}, "tokens"),
])
def test_skip_tokenizer_init_refuses_text(token_ids_only, path, body, param) -> None:
    server, _ = token_ids_only
    r = httpx.post(server.url(path), json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "--skip-tokenizer-init" in err["message"]
    assert httpx.get(server.url("/health")).status_code == 200
