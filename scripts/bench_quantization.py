"""How far int8 weights move the default model from float32: teacher-forced top-1
agreement, greedy text side by side, and the memory of weights and KV cache.

    PYTHONPATH=. python scripts/bench_quantization.py [--quantization int8] [--new-tokens 64]

For each prompt (chat-templated) the float32 model's greedy continuation is generated,
then both models read the same prompt + continuation in one forward and we count the
positions of the continuation where their argmax agrees. Speed is measured online with
`scripts/bench_workloads.py` against a server started with `--quantization int8`.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "models"))
from forward import prompt_logits  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.config import WeightFormat  # noqa: E402
from jaxserve.engine.resolve import resolve_packed_weights  # noqa: E402
from jaxserve.models import LlamaForCausalLM  # noqa: E402
from jaxserve.models.attention import ModelOptions  # noqa: E402
from jaxserve.models.loaders import load_checkpoint  # noqa: E402
from jaxserve.models.model_files import resolve_model  # noqa: E402
from jaxserve.models.quantization import pack_params, param_bytes, quantize_params  # noqa: E402
from jaxserve.models.tokenizer import load_tokenizer  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "List three uses of a paperclip.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Show your work.",
    "Write a Python function that reverses a string.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.",
    "What are the planets of the solar system?",
    "Write a short story opening about a lighthouse keeper.",
    "How do I make a good cup of coffee?",
    "What causes earthquakes?",
    "Name five fruits that are red.",
]


PAD = 128  # sequences are padded to a multiple (causal: padding after a position does not change it)


def top1(model: LlamaForCausalLM, params, seq: list[int]) -> np.ndarray:
    padded = seq + [0] * (-len(seq) % PAD)
    return np.argmax(prompt_logits(model, params, padded), axis=-1)[: len(seq)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = ap.parse_args()
    files = resolve_model(None)
    tok = load_tokenizer(files)
    sp = SamplingParams(temperature=0, max_tokens=args.new_tokens)
    chats = [[{"role": "user", "content": t}] for t in PROMPTS[: args.prompts]]
    texts = {}
    for q in (None, args.quantization):  # greedy text of each, through the engine
        llm = LLM(quantization=q, dtype="float32" if q is None else "auto", max_model_len=1024,
                  max_num_seqs=16)
        texts[q] = [o.outputs[0] for o in llm.chat(chats, sp, use_tqdm=False)]
        llm.shutdown()
    arch, host = load_checkpoint(files, np.float32)
    fmt = WeightFormat.of(args.quantization)
    qhost = quantize_params(host, fmt)
    # bf16 weights packed for oneDNN where the engine packs them (what its greedy texts ran).
    packed = resolve_packed_weights(fmt, jax.default_backend(), 1, 1)
    if packed:
        fmt = WeightFormat.BF16_PACKED
        qhost = pack_params(qhost, arch.tie_word_embeddings)
    f32 = LlamaForCausalLM(arch)
    q8 = LlamaForCausalLM(arch, ModelOptions(weight_format=fmt))
    p32, p8 = jax.device_put(host), jax.device_put(qhost)
    print(f"weights: float32 {param_bytes(p32) / 2**20:.1f} MiB, {args.quantization} "
          f"{param_bytes(p8) / 2**20:.1f} MiB{' (packed for oneDNN)' if packed else ''}; KV cache {arch.kv_bytes_per_token(4)} B/token (float32)")
    agree = total = 0
    same_text = 0
    for i, chat in enumerate(chats):
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tok.encode(prompt, add_special_tokens=False)
        ref, quant = texts[None][i], texts[args.quantization][i]
        seq = ids + list(ref.token_ids)
        a = top1(f32, p32, seq)[len(ids) - 1 : -1]
        b = top1(q8, p8, seq)[len(ids) - 1 : -1]
        agree += int((a == b).sum())
        total += len(a)
        same_text += ref.text == quant.text
        if i < 3:
            print(f"--- {chat[0]['content']}\n  float32: {ref.text!r}\n  {args.quantization}:    {quant.text!r}")
        print(f"prompt {i:2d}: {int((a == b).sum())}/{len(a)} agree", flush=True)
    print(f"identical greedy text: {same_text}/{len(chats)} prompts")
    print(f"top-1 agreement (teacher-forced, {args.prompts} prompts): {agree}/{total} = {100 * agree / total:.2f}%")


if __name__ == "__main__":
    main()
