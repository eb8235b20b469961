"""Offline throughput, with vLLM's flags: `python -m jaxserve.bench throughput
--num-prompts 64 --input-len 32 --output-len 256`.

Prompts are random token ids (fixed seed) and every request generates exactly
`--output-len` tokens (ignore_eos), as `vllm bench throughput` does.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from jaxserve.sampling_params import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> dict:
    from jaxserve.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        args.model, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=not args.no_async_scheduling, seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    startup = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed)
    vocab = llm.engine.worker.arch.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, args.input_len).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # touch every path once
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    result = {
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "elapsed_s": elapsed,
        "requests_per_s": len(outs) / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "startup_s": startup,
        "engine_timings": llm.engine.timings,
    }
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, "
          f"{result['total_tokens_per_s']:.1f} total tokens/s, "
          f"{result['output_tokens_per_s']:.1f} output tokens/s  "
          f"({args.num_prompts} prompts, {args.input_len} in, {args.output_len} out, {elapsed:.1f} s)")
    print(f"Start-up: {startup:.1f} s ({', '.join(f'{k}={v:.1f}' for k, v in llm.engine.timings.items())})")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
