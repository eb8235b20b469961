"""How long hostile request bodies stall another user's stream, against a running server.

One stream (400 tokens) runs while 8 copies of one kind of body arrive at once: a JSON schema
with a 3,000-value enum, 4,000 stop strings, 60 large tools under tool_choice "required", a
regex of 2,000 alternatives. Prints, per kind, the stream's median and longest gap between
chunks. Run it twice: the first run includes each grammar kind's first use.

    python -m jaxserve.serve --enable-auto-tool-choice --tool-call-parser hermes &
    python scripts/bench_hostile_bodies.py http://127.0.0.1:8000
"""

from __future__ import annotations

import asyncio
import sys
import time

import httpx

MODEL = "SmolLM2-135M-Instruct"


def bodies() -> dict[str, tuple[str, dict]]:
    ask = [{"role": "user", "content": "x"}]
    enum = {"type": "object", "properties": {"a": {"enum": [f"value-{i}" for i in range(3000)]}}}
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "d" * 500, "parameters": {
            "type": "object", "properties": {f"p{j}": {"type": "string", "description": "x" * 50}
                                             for j in range(40)}}}} for i in range(60)]
    regex = "(" + "|".join(f"w{i}[a-z]{{2,5}}" for i in range(2000)) + ")"
    return {
        "enum": ("/v1/chat/completions", {"messages": ask, "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": enum}}}),
        "stops": ("/v1/completions", {"prompt": "x", "stop": [f"stop word {i}" for i in range(4000)]}),
        "tools": ("/v1/chat/completions", {"messages": ask, "tools": tools,
                                           "tool_choice": "required"}),
        "regex": ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": regex}}),
    }


async def stream_gaps(client: httpx.AsyncClient, base: str) -> list[float]:
    gaps, last = [], None
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return sorted(gaps)


async def main(base: str) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        for name, (path, body) in bodies().items():
            stream = asyncio.create_task(stream_gaps(client, base))
            await asyncio.sleep(1.0)
            replies = await asyncio.gather(*[client.post(base + path, json={
                "model": MODEL, "max_tokens": 2, **body}) for _ in range(8)])
            gaps = await stream
            print(f"{name:6s} status {sorted({r.status_code for r in replies})}  stream gaps: "
                  f"median {gaps[len(gaps) // 2] * 1e3:.0f} ms, max {gaps[-1] * 1e3:.0f} ms",
                  flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"))
