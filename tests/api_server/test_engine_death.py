"""The engine-core process dies: in-flight requests fail, /health says 503, the server
exits non-zero, and nothing hangs. Also a failed start-up exits cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from .server_utils import ROOT, SMALL_ENGINE_ARGS, RemoteServer

pytestmark = pytest.mark.slow

LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def test_engine_death_fails_requests_and_exits_non_zero() -> None:
    with RemoteServer(SMALL_ENGINE_ARGS) as server:
        non_stream: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: non_stream.setdefault(
            "r", httpx.post(server.url("/v1/completions"), json=LONG, timeout=60)))
        t.start()
        with httpx.stream("POST", server.url("/v1/completions"), json={**LONG, "stream": True},
                          timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            os.kill(server.engine_pid(), signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert '"error"' in rest[-2] and "engine core" in rest[-2], rest[-3:]
        t.join(30)
        assert non_stream["r"].status_code == 500
        assert "died" in non_stream["r"].json()["error"]["message"]
        # /health reports 503 until the server exits (after a short grace period).
        health = httpx.get(server.url("/health"), timeout=5)
        assert health.status_code == 503
        assert server.proc.wait(timeout=30) == 1
        assert "engine core process died" in server.read_log()


def test_engine_startup_failure_exits_non_zero() -> None:
    # 100,000 tokens exceeds the model's context: the engine core refuses to start.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.serve", "--port", "0", "--max-model-len", "100000",
         "--kv-cache-memory-bytes", str(256 << 20)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "engine core failed to start" in proc.stderr and "100000" in proc.stderr
    assert time.monotonic() - t0 < 120


def test_bad_arguments_exit_before_starting_anything() -> None:
    for args in (["--model", "/no/such/model"], ["--block-size", "3"]):
        proc = subprocess.run([sys.executable, "-m", "jaxserve.serve", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "error:" in proc.stderr and "Traceback" not in proc.stderr
