"""Data parallelism through the server: two engine-core processes, requests balanced
between them, greedy text equal to the single-engine `LLM.generate`."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from tests.api_server.server_utils import EAGER, SMALL_ENGINE_ARGS, RemoteServer

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,", "To be or not to be,"] * 2


def test_dp2_balances_and_matches_single_engine() -> None:
    from jaxserve import LLM, SamplingParams

    with RemoteServer([*SMALL_ENGINE_ARGS, *EAGER, "--data-parallel-size", "2"]) as server:
        log = server.read_log()
        assert len(set(re.findall(r"engine core process (\d+) \(pid", log))) == 2

        async def run() -> list[str]:
            client = server.async_client()
            outs = await asyncio.gather(*(
                client.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=16,
                                          temperature=0.0)
                for p in PROMPTS))
            return [o.choices[0].text for o in outs], [o.id for o in outs]

        texts, ids = asyncio.run(run())
        # One trace store for both ranks: each trace says which engine core served it.
        engines = set()
        for rid in ids:
            t = httpx.get(server.url(f"/debug/requests/{rid}"), timeout=30).json()
            engines |= {e["engine"] for e in t["events"] if e["name"] == "sent"}
            assert {"scheduler", "model_runner"} <= {e["box"] for e in t["events"]}
        assert engines == {0, 1}
        assert httpx.get(server.url("/debug/stats"), timeout=30).json()["live"]["num_steps"] > 0
        metrics = httpx.get(server.url("/metrics")).text
        routed = {m[0]: float(m[1]) for m in re.findall(
            r'jaxserve:engine_requests_routed_total\{engine="(\d)",model_name="[^"]+"\} (\S+)', metrics)}
        assert routed.get("0", 0) >= 2 and routed.get("1", 0) >= 2, routed
        for engine in ("0", "1"):  # vLLM's per-engine series
            assert (f'vllm:num_requests_running{{engine="{engine}",model_name="SmolLM2-135M-Instruct"}}'
                    ' 0.0') in metrics
            assert f'vllm:generation_tokens_total{{engine="{engine}"' in metrics

    llm = LLM(max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=256 << 20, enforce_eager=True)
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert texts == [o.outputs[0].text for o in ref]
