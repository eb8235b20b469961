"""Offline throughput, with vLLM's flags: `python -m jaxserve.bench throughput
--num-prompts 64 --input-len 32 --output-len 256`.

Prompts are random token ids (fixed seed) and every request generates exactly
`--output-len` tokens (ignore_eos), as `vllm bench throughput` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.sampling_params import SamplingParams


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--structured-regex", default=None,
                   help="constrain every request to this regex (structured outputs): the grammar "
                        "mask's cost, e.g. '[a-z ]*'")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--output-json", default=None)
    p.add_argument("--step-stats", action="store_true",
                   help="time host work (scheduling, input preparation) and device waits per step")
    EngineArgs.add_cli_args(p, defaults={"max_model_len": 2048})


def run(args: argparse.Namespace) -> dict:
    from jaxserve.llm import LLM

    t0 = time.perf_counter()
    engine_args = dataclasses.asdict(EngineArgs.from_cli_args(args))
    llm = LLM(**engine_args)
    startup = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed)
    vocab = llm.engine.worker.arch.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, args.input_len).tolist()}
               for _ in range(args.num_prompts)]
    structured = None if args.structured_regex is None else ("regex", args.structured_regex)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.output_len, ignore_eos=True,
                            structured_outputs=structured)
    # Touch every path once; with a grammar, every batch size too (its masked sampler
    # compiles on first use, which must not land in the measurement).
    llm.generate(prompts if structured else prompts[:1],
                 SamplingParams(max_tokens=2, ignore_eos=True, structured_outputs=structured),
                 use_tqdm=False)
    timers = _instrument(llm) if args.step_stats else None
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids or ()) for o in outs)
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
    if timers is not None:
        steps = max(timers["steps"], 1)
        host = (timers["schedule"] + timers["update"] + timers["prepare"]) / steps * 1e3
        result["step_stats_ms"] = {
            "period": elapsed / steps * 1e3,
            "host": host,
            "schedule+update": (timers["schedule"] + timers["update"]) / steps * 1e3,
            "prepare+dispatch": timers["prepare"] / steps * 1e3,
            "wait_for_device": timers["wait"] / steps * 1e3,
            "steps": timers["steps"],
        }
        print("Per step (ms): " + ", ".join(f"{k}={v:.2f}" for k, v in result["step_stats_ms"].items()))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _instrument(llm) -> dict[str, float]:
    """Wrap the boxes' entry points with timers (benchmark only; no cost otherwise)."""
    timers = {"schedule": 0.0, "update": 0.0, "prepare": 0.0, "wait": 0.0, "steps": 0}
    sched, runner = llm.engine_core.scheduler, llm.engine.worker.runner

    def timed(obj, name: str, key: str, count: bool = False):
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[key] += time.perf_counter() - t
                if count:
                    timers["steps"] += 1

        setattr(obj, name, wrapper)

    timed(sched, "schedule", "schedule")
    timed(sched, "update_from_output", "update")
    timed(runner, "execute_model_async", "prepare", count=True)
    original = runner.read_output
    def to_output(*a, **k):  # the first device read of a step: its wait
        t = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            timers["wait"] += time.perf_counter() - t
    runner.read_output = to_output
    return timers
