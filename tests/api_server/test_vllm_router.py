"""vLLM's own router (`vllm-router`, the production stack's) in front of two jaxserve servers:
it finds them healthy, spreads requests over them, and serves their metrics under vLLM's names
and labels (`model_name` and `engine` on every series), as it does for vLLM servers."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .server_utils import EAGER, SMALL_ENGINE_ARGS, RemoteServer, free_port

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


def test_two_servers_behind_vllm_router(tmp_path) -> None:
    router_bin = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    # Both servers start at once (their loads and compiles overlap).
    with RemoteServer([*SMALL_ENGINE_ARGS, *EAGER], wait_healthy=False) as a, \
            RemoteServer([*SMALL_ENGINE_ARGS, *EAGER], wait_healthy=False) as b:
        a._wait_until_healthy(240)
        b._wait_until_healthy(240)
        port = free_port()
        log = open(tmp_path / "router.log", "w")
        router = subprocess.Popen(
            [router_bin, "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
             a.base_url, b.base_url, "--policy", "round_robin"], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, (tmp_path / "router.log").read_text()[-2000:]
                time.sleep(0.25)
            for i in range(4):
                r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                    "model": MODEL, "max_tokens": 4, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Count to {i}."}]})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text

            def served() -> list[float]:  # finished requests per server, from its metrics
                out = []
                for server in (a, b):
                    text = httpx.get(server.url("/metrics")).text
                    m = re.search(r'vllm:request_success_total\{engine="0",finished_reason="length",'
                                  rf'model_name="{MODEL}"\}} (\S+)', text)
                    out.append(float(m.group(1)) if m else 0.0)
                return out

            # Round robin over both (the router's own probes may shift the turn). A server
            # counts a request once its output is handled, which may trail the response.
            running = rf'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0.0'
            deadline = time.monotonic() + 20
            while sum(counts := served()) < 4 or not re.search(
                    running, proxied := httpx.get(url + "/metrics", timeout=10).text):
                assert time.monotonic() < deadline, (counts, proxied[:2000])
                time.sleep(0.25)
            assert sum(counts) == 4 and min(counts) >= 1, counts
        finally:
            router.terminate()
            router.wait(10)
