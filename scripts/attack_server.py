"""Send a running server the inputs a careless client or an attacker sends, and report.

    python scripts/attack_server.py --base-url http://127.0.0.1:8000 [--pid API_SERVER_PID]

For every class of bad input (integers out of range, wrong types, invalid Unicode, bad
content parts, oversized or over-counted requests, user chat templates, malformed JSON,
bad streamed requests) it prints how many cases were sent and which status codes came back;
then /health's worst latency while the heaviest requests were being refused, and (with
--pid) the API server's resident memory before and after 1,000 failing requests. The case
table is also the parametrized test table of tests/api_server/test_bad_inputs.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import httpx

HI = [{"role": "user", "content": "Hi!"}]
BOMB = "{% for i in range(999999999) %}{{ i }}{% endfor %}"


@dataclass(frozen=True)
class Case:
    kind: str
    name: str
    path: str
    body: Any  # a JSON-able body, or raw bytes sent as they are
    expect: int = 400  # the status a well-behaved server answers

    def content(self) -> bytes:
        # NOTE: ensure_ascii keeps lone surrogates as \ud800 escapes, as a client sends them.
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


def _c(kind: str, name: str, body: Any, path: str = "/v1/completions", expect: int = 400) -> Case:
    return Case(kind, name, path, body, expect)


CHAT = "/v1/chat/completions"
CASES: list[Case] = [
    # Integers the engine cannot carry (int32 arrays, int64 messages) or must not accept.
    _c("int out of range", "top_k 2^31", {"prompt": "x", "top_k": 2**31}),
    _c("int out of range", "top_k 2^63", {"prompt": "x", "top_k": 2**63}),
    _c("int out of range", "top_k 10^30", {"prompt": "x", "top_k": 10**30}),
    _c("int out of range", "top_k > vocab", {"prompt": "x", "top_k": 10**6}),
    _c("int out of range", "seed 2^64", {"prompt": "x", "seed": 2**64}),
    _c("int out of range", "seed -2^64", {"prompt": "x", "seed": -(2**64)}),
    _c("int out of range", "priority 2^63", {"prompt": "x", "priority": 2**63}),
    _c("int out of range", "priority -2^70", {"prompt": "x", "priority": -(2**70)}),
    _c("int out of range", "stop_token_ids 2^64", {"prompt": "x", "stop_token_ids": [2**64]}),
    _c("int out of range", "stop_token_ids -1", {"prompt": "x", "stop_token_ids": [-1]}),
    _c("int out of range", "stop_token_ids > vocab", {"prompt": "x", "stop_token_ids": [10**9]}),
    _c("int out of range", "max_tokens 2^63", {"prompt": "x", "max_tokens": 2**63}),
    _c("int out of range", "max_tokens 0", {"prompt": "x", "max_tokens": 0}),
    _c("int out of range", "min_tokens 2^40", {"prompt": "x", "min_tokens": 2**40}),
    _c("int out of range", "logprobs 10^20", {"prompt": "x", "logprobs": 10**20}),
    _c("int out of range", "top_logprobs 10^20", {"messages": HI, "logprobs": True,
                                                  "top_logprobs": 10**20}, CHAT),
    _c("int out of range", "best_of 10^9", {"prompt": "x", "best_of": 10**9}),
    _c("int out of range", "prompt token 2^40", {"prompt": [2**40]}),
    _c("int out of range", "detokenize 2^63", {"tokens": [2**63]}, "/detokenize"),
    # Wrong types: an error, never a silent coercion.
    _c("wrong type", "max_tokens true", {"prompt": "x", "max_tokens": True}),
    _c("wrong type", "stream 'yes'", {"prompt": "x", "stream": "yes"}),
    _c("wrong type", "n '2'", {"prompt": "x", "n": "2"}),
    _c("wrong type", "temperature 'hot'", {"prompt": "x", "temperature": "hot"}),
    _c("wrong type", "prompt 5", {"prompt": 5}),
    _c("wrong type", "role 1", {"messages": [{"role": 1, "content": "x"}]}, CHAT),
    _c("wrong type", "stop 5", {"prompt": "x", "stop": 5}),
    _c("wrong type", "top_k 1.5", {"prompt": "x", "top_k": 1.5}),
    _c("wrong type", "ignore_eos 'true'", {"prompt": "x", "ignore_eos": "true"}),
    _c("wrong type", "seed 1.5", {"prompt": "x", "seed": 1.5}),
    _c("wrong type", "include_usage 'yes'", {"prompt": "x", "stream": True,
                                            "stream_options": {"include_usage": "yes"}}),
    _c("wrong type", "messages 'hi'", {"messages": "hi"}, CHAT),
    # Strings that cannot be encoded (lone surrogates).
    _c("invalid unicode", "prompt", {"prompt": "a\ud800b"}),
    _c("invalid unicode", "prompt list", {"prompt": ["ok", "\udfff"]}),
    _c("invalid unicode", "chat content", {"messages": [{"role": "user", "content": "\udfff"}]}, CHAT),
    _c("invalid unicode", "content part", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\ud800"}]}]}, CHAT),
    _c("invalid unicode", "stop", {"prompt": "x", "stop": ["\ud800"]}),
    _c("invalid unicode", "stop, streamed", {"prompt": "x", "stop": ["\ud800"], "stream": True}),
    _c("invalid unicode", "tokenize", {"prompt": "\ud800"}, "/tokenize"),
    _c("invalid unicode", "model", {"model": "\ud800", "prompt": "x"}),
    # Content parts.
    _c("content parts", "text 5", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}, CHAT),
    _c("content parts", "no text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
       CHAT),
    _c("content parts", "image", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, CHAT),
    _c("content parts", "part 5", {"messages": [{"role": "user", "content": [5]}]}, CHAT),
    _c("content parts", "content object", {"messages": [{"role": "user", "content": {"a": 1}}]}, CHAT),
    # Sizes and counts.
    _c("size and count", "n 100000", {"prompt": "x", "n": 100000}),
    _c("size and count", "n 100000 chat", {"messages": HI, "n": 100000}, CHAT),
    _c("size and count", "1000 prompts", {"prompt": ["x"] * 1000}),
    _c("size and count", "10 prompts x n 128", {"prompt": ["x"] * 10, "n": 128}),
    _c("size and count", "2M-character prompt", {"prompt": "a " * 1_000_000}),
    _c("size and count", "2M-character chat", {"messages": [{"role": "user", "content": "a " * 1_000_000}]},
       CHAT),
    _c("size and count", "50 MB body", b'{"prompt": "' + b"a" * (50 << 20) + b'"}', expect=413),
    _c("size and count", "prompt > max_model_len", {"prompt": "x " * 5000}),
    # Chat templates sent by the client (cost unbounded).
    _c("chat template", "chat_template_kwargs", {"messages": HI, "chat_template_kwargs": {
        "chat_template": BOMB}}, CHAT),
    _c("chat template", "chat_template", {"messages": HI, "chat_template": BOMB}, CHAT),
    # Tools the server cannot serve (this server has no --enable-auto-tool-choice).
    _c("tools", "auto without a tool parser", {"messages": HI, "tools": [
        {"type": "function", "function": {"name": "f"}}]}, CHAT),
    _c("tools", "tools not a list", {"messages": HI, "tools": "f", "tool_choice": "required"}, CHAT),
    # Malformed bodies.
    _c("malformed JSON", "truncated", b'{"prompt": "x"'),
    _c("malformed JSON", "array", b"[]"),
    _c("malformed JSON", "null", b"null"),
    _c("malformed JSON", "empty", b""),
    _c("malformed JSON", "not UTF-8", b'{"prompt": "\xff\xfe"}'),
    # Streamed requests: refused before the stream starts, not with 200 and an in-band error.
    _c("bad streamed request", "stop ''", {"prompt": "x", "stop": [""], "stream": True}),
    _c("bad streamed request", "temperature -1", {"prompt": "x", "temperature": -1, "stream": True}),
    _c("bad streamed request", "chat top_p 2", {"messages": HI, "top_p": 2, "stream": True}, CHAT),
    _c("bad streamed request", "unknown model", {"model": "nope", "prompt": "x", "stream": True},
       expect=404),
]

# The heaviest to refuse: /health must keep answering while they are.
HEAVY = ["50 MB body", "2M-character prompt", "2M-character chat", "chat_template_kwargs",
         "1000 prompts", "n 100000"]


async def send(client: httpx.AsyncClient, base: str, case: Case) -> int:
    """The status code, or 0 when the server gave no answer (it died or hung up)."""
    try:
        r = await client.post(base + case.path, content=case.content(),
                              headers={"Content-Type": "application/json"})
    except httpx.HTTPError:
        return 0
    return r.status_code


async def alive(client: httpx.AsyncClient, base: str) -> bool:
    try:
        return (await client.get(base + "/health")).status_code == 200
    except httpx.HTTPError:
        return False


async def health_while(client: httpx.AsyncClient, base: str, work: asyncio.Task) -> float:
    """Worst /health latency (s) observed while `work` runs."""
    worst = 0.0
    while not work.done():
        t = time.perf_counter()
        await client.get(base + "/health")
        worst = max(worst, time.perf_counter() - t)
        await asyncio.sleep(0.05)
    return worst


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def attack(base: str, pid: int | None, failing: int, start: int = 0,
                 skip_heavy: bool = False, api_key: str | None = None) -> dict[str, Any]:
    """Run the cases from `start`; stops early (with "killed_by") if one takes the server down.
    `skip_heavy` leaves out the HEAVY cases (a server without limits can take hours on them)."""
    results: dict[str, Any] = {"classes": {}, "cases": {}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(timeout=120, headers=headers) as client:
        by_kind: dict[str, Counter] = defaultdict(Counter)
        for i, case in enumerate(CASES[start:], start):
            if skip_heavy and case.name in HEAVY:
                continue
            status = await send(client, base, case)
            results["cases"][f"{case.kind}: {case.name}"] = status
            by_kind[case.kind][status] += 1
            if not await alive(client, base):
                results["killed_by"] = [i, f"{case.kind}: {case.name}"]
                results["classes"] = {k: dict(v) for k, v in by_kind.items()}
                return results
        results["classes"] = {k: dict(v) for k, v in by_kind.items()}
        if skip_heavy:
            return results
        heavy = [c for c in CASES if c.name in HEAVY]
        work = asyncio.ensure_future(asyncio.gather(*(send(client, base, c) for c in heavy * 2)))
        results["health_worst_s"] = await health_while(client, base, work)
        await work
        ok = await client.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        results["still_serving"] = ok.status_code == 200
        if pid is not None:
            bad = [c for c in CASES if c.name not in HEAVY]
            before = rss_kib(pid)
            for i in range(failing):
                await send(client, base, bad[i % len(bad)])
            results["rss_kib"] = [before, rss_kib(pid)]
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--pid", type=int, default=None, help="the API server's pid (for its RSS)")
    p.add_argument("--failing", type=int, default=1000)
    p.add_argument("--start", type=int, default=0, help="first case to send (after a restart)")
    p.add_argument("--skip-heavy", action="store_true",
                   help="leave out the heaviest cases and the health/RSS phases")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    r = asyncio.run(attack(args.base_url.rstrip("/"), args.pid, args.failing, args.start,
                           args.skip_heavy, args.api_key))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(r, f, indent=2)
    if "killed_by" in r:
        print(f"the server went down after case {r['killed_by'][0]} ({r['killed_by'][1]})")
    print("| class of bad input | cases | status codes |")
    print("|---|---|---|")
    for kind, codes in r["classes"].items():
        shown = ", ".join(f"{code} x{n}" for code, n in sorted(codes.items()))
        print(f"| {kind} | {sum(codes.values())} | {shown} |")
    if "killed_by" in r:
        return 3
    if "health_worst_s" in r:
        print(f"/health worst latency while the heaviest requests were refused: "
              f"{r['health_worst_s'] * 1e3:.0f} ms; still serving: {r['still_serving']}")
    if "rss_kib" in r:
        print(f"API server RSS before / after {args.failing} failing requests: "
              f"{r['rss_kib'][0] / 1024:.1f} / {r['rss_kib'][1] / 1024:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
