"""The serving workloads of docs/benchmarks.md, against any running OpenAI-compatible server.

    python scripts/bench_workloads.py run --base-url http://127.0.0.1:8000 --label jaxserve \\
        [--workloads decode64,long1,...] [--out docs/bench]
    python scripts/bench_workloads.py report [--out docs/bench]   # table + docs/benchmarks.png

`run` drives `python -m jaxserve.bench serve` once per workload and saves its JSON as
OUT/LABEL-WORKLOAD.json; `report` prints the markdown table (with each workload's roofline
on this machine) and draws the plot. Prompt lengths are tokens of the default model's
tokenizer; "N-word" prompts are taken as ~1.17 tokens per word (measured on English prose).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from dataclasses import dataclass

from jaxserve.bench.__main__ import main as bench_main


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    num_prompts: int
    concurrency: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    prefix_len: int = 0


WORKLOADS = [
    Workload("short1", "24-word prompt, 128 out, one at a time", 4, 1, 28, 128),
    Workload("long1", "~1,800-token prompt, 16 out, one at a time", 3, 1, 1800, 16),
    Workload("ctx2k1", "2,000-token prompt, 64 out, one at a time (TPOT at 2k context)", 2, 1, 2000, 64),
    Workload("short16", "24-word prompts, 128 out, concurrency 16", 32, 16, 28, 128),
    Workload("words256c16", "256-word prompts (300 tokens), 128 out, concurrency 16", 32, 16, 300, 128),
    Workload("words512c64", "512-word prompts (600 tokens), 64 out, concurrency 64", 128, 64, 600, 64),
    Workload("mixedc16", "mixed: 600 +-50% tokens in, 128 +-50% out, concurrency 16", 48, 16, 600, 128, 0.5),
    Workload("prefixc16", "shared 1,024-token prefix + 64 own tokens, 64 out, concurrency 16", 48, 16, 64, 64,
             prefix_len=1024),
    Workload("decode64", "32-token prompts, 256 out, concurrency 64 (decode-heavy)", 128, 64, 32, 256),
]
BY_NAME = {w.name: w for w in WORKLOADS}

# This machine (2 cores), measured: XLA's float32 matmul peak and two-thread read bandwidth.
PEAK_FLOPS = 150e9
BANDWIDTH = 31e9
# The default model (SmolLM2-135M, float32).
LAYERS, HIDDEN, HEADS, HEAD_DIM, KV_HEADS, VOCAB = 30, 576, 9, 64, 3, 49152
WEIGHT_BYTES = 4 * 134.5e6
LAYER_FLOPS_PER_TOKEN = 2 * 106.2e6  # non-embedding matmuls
KV_BYTES_PER_TOKEN = 4 * 2 * LAYERS * KV_HEADS * HEAD_DIM


def roofline(w: Workload) -> dict[str, float]:
    """Best case on this machine: every prompt token costs its matmul and causal attention
    FLOPs at the matmul peak; every decode step reads the weights and the batch's KV at
    full bandwidth (prefix tokens counted once: they are cached). Returns the floors of the
    whole run (s), of one request's TTFT (s) and of TPOT (s) at the workload's batch."""
    own = w.input_len
    prefill_tokens = w.prefix_len + w.num_prompts * own
    ctx = w.prefix_len + own
    attn = 4 * HEADS * HEAD_DIM * LAYERS  # FLOPs per (query, key) pair
    prefill_flops = prefill_tokens * LAYER_FLOPS_PER_TOKEN + w.num_prompts * attn * (ctx * ctx / 2)
    batch = min(w.concurrency, w.num_prompts)
    step_bytes = WEIGHT_BYTES + batch * (ctx + w.output_len / 2) * KV_BYTES_PER_TOKEN
    step_flops = batch * (LAYER_FLOPS_PER_TOKEN + 2 * HIDDEN * VOCAB)
    tpot = max(step_bytes / BANDWIDTH, step_flops / PEAK_FLOPS)
    steps = w.output_len * -(-w.num_prompts // batch)
    ttft = (own * LAYER_FLOPS_PER_TOKEN + attn * ctx * ctx / 2) / PEAK_FLOPS
    return {"total_s": prefill_flops / PEAK_FLOPS + steps * tpot, "ttft_s": ttft, "tpot_s": tpot}


def run(args: argparse.Namespace) -> None:
    os.makedirs(args.out, exist_ok=True)
    names = args.workloads.split(",") if args.workloads else [w.name for w in WORKLOADS]
    for name in names:
        w = BY_NAME[name]
        out = os.path.join(args.out, f"{args.label}-{w.name}.json")
        argv = ["serve", "--base-url", args.base_url, "--num-prompts", str(w.num_prompts),
                "--max-concurrency", str(w.concurrency), "--random-input-len", str(w.input_len),
                "--random-output-len", str(w.output_len), "--random-range-ratio", str(w.range_ratio),
                # A seed per workload: with one seed, a longer workload's prompts would start
                # with a shorter one's tokens and hit the server's prefix cache.
                "--random-prefix-len", str(w.prefix_len), "--seed", str(WORKLOADS.index(w) + 1),
                "--output-json", out]
        if args.tokenizer:
            argv += ["--tokenizer", args.tokenizer]
        print(f"== {args.label} {w.name}: {w.what}", flush=True)
        bench_main(argv)


def _load(out: str) -> dict[tuple[str, str], dict]:
    results = {}
    for path in glob.glob(os.path.join(out, "*.json")):
        label, name = os.path.basename(path)[:-5].rsplit("-", 1)
        with open(path) as f:
            results[(label, name)] = json.load(f)
    return results


def report(args: argparse.Namespace) -> None:
    results = _load(args.out)
    labels = sorted({label for label, _ in results}, key=lambda l: (l != "jaxserve", l))
    print("| workload | server | out tok/s | total tok/s | TTFT mean / p99 (ms) | TPOT mean / p99 (ms) "
          "| float32 roofline: tok/s, TTFT, TPOT | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for w in WORKLOADS:
        roof = roofline(w)
        total_tokens = w.num_prompts * (w.prefix_len + w.input_len + w.output_len)
        for label in labels:
            m = results.get((label, w.name))
            if m is None:
                continue
            print(f"| {w.what} | {label} | {m['output_throughput']:.1f} | {m['total_token_throughput']:.1f} "
                  f"| {m['mean_ttft_ms']:.0f} / {m['p99_ttft_ms']:.0f} | {m['mean_tpot_ms']:.1f} / "
                  f"{m['p99_tpot_ms']:.1f} | {total_tokens / roof['total_s']:.0f}, "
                  f"{roof['ttft_s'] * 1e3:.0f} ms, {roof['tpot_s'] * 1e3:.1f} ms | {m['failed']} |")
    _plot(results, labels, os.path.join(os.path.dirname(args.out.rstrip("/")) or ".", "benchmarks.png"))


def _plot(results, labels, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [w.name for w in WORKLOADS if (labels[0], w.name) in results]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    x = np.arange(len(names))
    width = 0.8 / (len(labels) + 1)
    for i, label in enumerate(labels):
        ys = [results.get((label, n), {}).get("total_token_throughput", 0) for n in names]
        axes[0].bar(x + i * width, ys, width, label=label)
        ts = [results.get((label, n), {}).get("mean_tpot_ms", 0) for n in names]
        axes[1].bar(x + i * width, ts, width, label=label)
    roof = [roofline(BY_NAME[n]) for n in names]
    tot = [BY_NAME[n].num_prompts * (BY_NAME[n].prefix_len + BY_NAME[n].input_len + BY_NAME[n].output_len)
           / r["total_s"] for n, r in zip(names, roof)]
    axes[0].bar(x + len(labels) * width, tot, width, label="roofline", color="lightgray")
    axes[1].bar(x + len(labels) * width, [r["tpot_s"] * 1e3 for r in roof], width, label="roofline",
                color="lightgray")
    for ax, title in zip(axes, ["processed tokens/s (prompt + output), higher is better",
                                "TPOT mean (ms), lower is better"]):
        ax.set_xticks(x + width * len(labels) / 2, names, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend()
    for ax in axes:
        ax.set_yscale("log")
    fig.suptitle("2 CPU cores, SmolLM2-135M; roofline: float32 weights at XLA's float32 peak (docs/benchmarks.md)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--base-url", default="http://127.0.0.1:8000")
    r.add_argument("--label", default="jaxserve")
    r.add_argument("--workloads", default=None, help=f"comma-separated, from: {', '.join(BY_NAME)}")
    r.add_argument("--tokenizer", default=None)
    r.add_argument("--out", default="docs/bench")
    rp = sub.add_parser("report")
    rp.add_argument("--out", default="docs/bench")
    args = p.parse_args(argv)
    (run if args.cmd == "run" else report)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
