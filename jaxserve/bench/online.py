"""Online serving benchmark, shaped like `vllm bench serve`:

    python -m jaxserve.bench serve --base-url http://127.0.0.1:8000 --num-prompts 256 \
        --max-concurrency 64 --random-input-len 32 --random-output-len 256

Random prompts (vLLM's random dataset: random token ids decoded to text and re-encoded
until the text has the wanted length), streamed through `/v1/completions` with
`ignore_eos` so each request generates exactly its output length. The workloads a serving
user runs:

  * long prompts: `--random-input-len 1800`;
  * mixed lengths: `--random-range-ratio 0.5` draws every input and output length
    uniformly from [len * (1 - r), len * (1 + r)];
  * a shared prefix: `--random-prefix-len 1024` puts the same 1,024 tokens before every
    prompt (a system prompt / few-shot header), which prefix caching computes once.

Works against any OpenAI-compatible server (`ignore_eos` is vLLM's extension; servers
without it stop early and report fewer output tokens). Reports request and token
throughput, and mean / median / percentiles (`--metric-percentiles`) of TTFT, TPOT, ITL and
end-to-end latency, as text and (with --output-json) JSON. JAX-free.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--tokenizer", default=None,
                   help="HF directory or .gguf for building prompts (default: the default model's)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson arrivals (inf: all at once)")
    p.add_argument("--random-input-len", type=int, default=32)
    p.add_argument("--random-output-len", type=int, default=256)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="draw input and output lengths from [len*(1-r), len*(1+r)]")
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of one shared random prefix put before every prompt")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics to report percentiles of (ttft, tpot, itl, e2el)")
    p.add_argument("--metric-percentiles", default="50,90,99",
                   help="comma-separated percentiles, e.g. 50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-ids", action="store_true",
                   help="send prompts as token ids instead of text")
    p.add_argument("--output-json", default=None)


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""


def sample_lengths(length: int, ratio: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """n lengths uniform in [length * (1 - ratio), length * (1 + ratio)] (vLLM's rule)."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.integers(lo, hi + 1, n)


def make_prompts(args: argparse.Namespace, tok: Any) -> list[tuple[str | list[int], int, int]]:
    """(prompt, its length in tokens, output length) per request."""
    rng = np.random.default_rng(args.seed)
    vocab = len(tok)
    n_prompts = args.num_prompts
    in_lens = sample_lengths(args.random_input_len, args.random_range_ratio, n_prompts, rng)
    out_lens = sample_lengths(args.random_output_len, args.random_range_ratio, n_prompts, rng)
    prefix = rng.integers(100, vocab - 100, args.random_prefix_len).tolist()
    prompts: list[tuple[str | list[int], int, int]] = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        n = len(prefix) + n_in
        ids = prefix + rng.integers(100, vocab - 100, n_in).tolist()
        if args.token_ids:
            prompts.append((ids, n, n_out))
            continue
        for _ in range(8):  # decoding and re-encoding can merge or split tokens
            text = tok.decode(ids)
            ids = tok(text, add_special_tokens=False).input_ids
            if len(ids) >= n:
                ids = ids[:n]
            else:
                ids = ids + rng.integers(100, vocab - 100, n - len(ids)).tolist()
        text = tok.decode(ids)
        prompts.append((text, len(tok(text, add_special_tokens=False).input_ids), n_out))
    return prompts


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                       prompt_len: int) -> RequestResult:
    """One streaming completion, timed per chunk like vLLM's benchmark."""
    result = RequestResult(prompt_len=prompt_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.text += chunk["choices"][0].get("text") or ""
                elif chunk.get("usage"):
                    result.output_tokens = chunk["usage"].get("completion_tokens") or 0
        result.latency = time.perf_counter() - start
        result.success = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from jaxserve.models.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    prompts = make_prompts(args, tok)
    base = args.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        model = args.model or (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        url = f"{base}{args.endpoint}"

        def body(prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
            return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

        # A test request with its own prompt: sending a benchmark prompt here would put it in
        # the prefix cache and flatter that request's TTFT.
        test_prompt = "Hello" if isinstance(prompts[0][0], str) else [100, 101, 102]
        test = await send_request(client, url, body(test_prompt, 8), 0)
        if not test.success:
            raise SystemExit(f"the test request failed: {test.error}")
        sem = asyncio.Semaphore(args.max_concurrency or len(prompts))
        rng = np.random.default_rng(args.seed)

        async def limited(prompt: str | list[int], n_in: int, n_out: int) -> RequestResult:
            async with sem:
                return await send_request(client, url, body(prompt, n_out), n_in)

        print(f"Traffic: {len(prompts)} requests, request rate {args.request_rate}, "
              f"max concurrency {args.max_concurrency}")
        start = time.perf_counter()
        tasks = []
        for prompt, n_in, n_out in prompts:
            tasks.append(asyncio.create_task(limited(prompt, n_in, n_out)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    for r in results:  # servers that stream no usage (llama.cpp's): count as vLLM's bench does
        if r.success and r.output_tokens == 0 and r.text:
            r.output_tokens = len(tok(r.text, add_special_tokens=False).input_ids)
    return calculate_metrics(args, model, results, duration)


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    v = np.asarray(values_s or [0.0]) * 1000.0
    out = {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(v.std())}
    for q in percentiles:
        out[f"p{q:g}_{name}_ms"] = float(np.percentile(v, q))
    return out


def calculate_metrics(args: argparse.Namespace, model: str, results: list[RequestResult],
                      duration: float) -> dict[str, Any]:
    """vLLM's summary: TPOT per request = (latency - TTFT) / (output tokens - 1)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    pct = [float(q) for q in args.metric_percentiles.split(",") if q.strip()]
    metrics = set(args.percentile_metrics.split(","))
    values = {"ttft": [r.ttft for r in ok], "tpot": tpots,
              "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
    out: dict[str, Any] = {
        "model": model, "num_prompts": len(results), "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate, "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio, "random_prefix_len": args.random_prefix_len,
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "percentiles": pct,
        "errors": sorted({r.error for r in results if not r.success})[:5],
    }
    for name, v in values.items():
        out.update(_stats(name, v, pct if name in metrics else [99.0]))
    return out


def print_report(m: dict[str, Any]) -> None:
    line = "=" * 50
    print(f"{' Serving Benchmark Result ':=^50}")
    rows = [
        ("Successful requests:", m["completed"]), ("Failed requests:", m["failed"]),
        ("Maximum request concurrency:", m["max_concurrency"]),
        ("Benchmark duration (s):", f"{m['duration']:.2f}"),
        ("Total input tokens:", m["total_input_tokens"]),
        ("Total generated tokens:", m["total_output_tokens"]),
        ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{m['total_token_throughput']:.2f}"),
    ]
    for k, v in rows:
        print(f"{k:<40}{v!s:<10}")
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{title:-^50}")
        stats = ["mean", "median"] + [k.split("_")[0] for k in m if k.startswith("p") and
                                      k.endswith(f"_{key}_ms")]
        for stat in stats:
            label = f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {key.upper()} (ms):"
            print(f"{label:<40}{m[f'{stat}_{key}_ms']:<10.2f}")
    print(line)
    for e in m["errors"]:
        print(f"error: {e}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    metrics = asyncio.run(benchmark(args))
    print_report(metrics)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(metrics, f, indent=2)
    return metrics
