"""Where a decode step's device time goes on the CPU: each XLA op's share of the compiled
steps, grouped (matmuls, attention, sampler, ...), from a JAX profiler trace of the engine.

    python scripts/profile_step.py --num-seqs 64 --input-len 32 [--context 2048] [--top 25]

Runs the default model (or --model) offline: one warm-up generate, then a traced one; the
trace is read with xprof's converter (`pip install xprof`, a profiling tool only, not a
jaxserve dependency). Prints the groups' and the top ops' share of the XLA ops' time (self time per op, summed
over the CPU's threads), prefill of the traced run included.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import tempfile
import time

# XLA CPU thunk names (numeric suffix dropped) -> what they are in a decoder step.
_GROUPS = (("matmul (YNNPACK / oneDNN / Eigen dots; kernels_pallas FFI: matmuls, decode attention)",
            ("ynn_fusion", "dot", "onednn", "convolution", "ffi_call", "custom-call")),
           ("layer-scan weight slices", ("dynamic-slice",)),
           ("gathers (KV pages, embedding, penalty rows)", ("gather",)),
           ("scatters and cache writes", ("scatter", "dynamic-update-slice")),
           ("copies and transposes", ("copy", "transpose")),
           ("selects (masks)", ("select",)),
           ("exp / softmax", ("exponential", "softmax")))
_WRAPPERS = ("ThreadpoolListener", "ThunkExecutor", "SlinkyThreadPool", "CommonPjRt",
             "PjitFunction", "PjRt")


def op_group(name: str) -> str:
    """A coarse name for an XLA CPU op."""
    for group, words in _GROUPS:
        if any(w in name for w in words):
            return group
    return "other elementwise / control"


def op_self_times(trace_events: list[dict]) -> collections.Counter[str]:
    """Each op's self time (us; its duration less the ops nested in it), summed over the XLA
    threads; Python frames and the runtime's wrappers are left out."""
    by_thread: dict[tuple, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in trace_events:
        if e.get("ph") == "X" and not e["name"].startswith(("$", *_WRAPPERS)):
            by_thread[(e["pid"], e["tid"])].append((e["ts"], e.get("dur", 0.0), e["name"]))
    self_time: collections.Counter[str] = collections.Counter()
    for events in by_thread.values():
        events.sort(key=lambda t: (t[0], -t[1]))
        stack: list[list] = []  # [end, name, nested time, duration]

        def close(upto: float) -> None:
            while stack and stack[-1][0] <= upto:
                _, name, nested, dur = stack.pop()
                self_time[re.sub(r"\.\d+$", "", name)] += dur - nested
                if stack:
                    stack[-1][2] += dur

        for ts, dur, name in events:
            close(ts)
            stack.append([ts + dur, name, 0.0, dur])
        close(float("inf"))
    return self_time


def ffi_calls(trace_events: list[dict]) -> dict[tuple[str, str], list[float]]:
    """The custom calls' (kernels_pallas FFI: matmuls, decode attention) durations (us), by
    program and HLO op (the trace's one name for them all is `ffi_call`): e.g. the seven
    projections and the attention of a layer are eight ops of `jit_stage_fn`, each run once
    per layer per step; the LM head is `jit_sample_fn`'s."""
    calls: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for e in trace_events:
        if e.get("ph") == "X" and e["name"].startswith("ffi_call"):
            args = e.get("args", {})
            calls[(args.get("hlo_module", "?"), args.get("hlo_op", e["name"]))].append(e.get("dur", 0.0))
    return calls


def main() -> None:
    """Profile the engine's decode steps and print where the device time goes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--context", type=int, default=0,
                        help="prompt tokens already in each sequence (long-context decode)")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--prefill", action="store_true",
                        help="trace new prompts (the warm-up's would hit the prefix cache): the prefill's ops")
    parser.add_argument("--quantization", "-q", default=None, help="int8 or bf16 weights")
    args = parser.parse_args()

    import jax
    from xprof.convert import raw_to_tool_data

    from jaxserve import LLM, SamplingParams

    prompt_len = max(args.input_len, args.context)
    llm = LLM(args.model, max_num_seqs=args.num_seqs, max_model_len=prompt_len + 2 * args.output_len + 16,
              quantization=args.quantization)
    def prompts(offset: int) -> list[dict]:
        return [{"prompt_token_ids": [(7 * i + 13 * s + offset) % 4000 + 100 for i in range(prompt_len)]}
                for s in range(args.num_seqs)]

    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts(0), greedy, use_tqdm=False)  # warm-up (and the prefix cache)
    out_dir = tempfile.mkdtemp(prefix="jaxserve-profile-")
    t0 = time.perf_counter()
    with jax.profiler.trace(out_dir):
        llm.generate(prompts(1 if args.prefill else 0), greedy, use_tqdm=False)
    wall = time.perf_counter() - t0
    llm.shutdown()
    print("trace:", out_dir)
    xspace = glob.glob(os.path.join(out_dir, "**", "*.xplane.pb"), recursive=True)
    data, _ = raw_to_tool_data.xspace_to_tool_data(xspace, "trace_viewer", {})
    events = json.loads(data)["traceEvents"]
    ops = op_self_times(events)
    total = sum(ops.values())
    if not total:
        raise SystemExit(f"no XLA ops in the trace ({xspace})")
    groups: collections.Counter[str] = collections.Counter()
    for name, us in ops.items():
        groups[op_group(name)] += us
    print(f"{args.num_seqs} sequences x {args.output_len} tokens, {prompt_len}-token prompts: "
          f"{wall:.2f} s traced, {total / 1e3:.1f} ms of XLA op time (summed over threads)")
    for g, us in groups.most_common():
        print(f"  {100 * us / total:5.1f}%  {us / 1e3:9.1f} ms  {g}")
    print(f"top {args.top} ops:")
    for name, us in ops.most_common(args.top):
        print(f"  {100 * us / total:5.1f}%  {us / 1e3:9.1f} ms  {name}")
    calls = ffi_calls(events)
    print("FFI calls by program and op (count, total, mean):")
    for (module, op), durs in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[: args.top]:
        print(f"  {module:>18} {op:<14} {len(durs):6d}  {sum(durs) / 1e3:9.1f} ms  {sum(durs) / len(durs):9.1f} us")


if __name__ == "__main__":
    main()
