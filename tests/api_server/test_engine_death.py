"""The engine core fails: killed (SIGKILL) or its worker raises on the N-th forward (vLLM's
fault injection). Every in-flight request gets an error, new requests get 503, /health
says 503, the server exits non-zero, its IPC files are gone and nothing hangs. Also a
failed start-up exits cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from .server_utils import EAGER, ROOT, SMALL_ENGINE_ARGS, RemoteServer, ipc_files, process_gone

pytestmark = pytest.mark.slow

LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def wait_running(server: RemoteServer, n: int, timeout: float = 180) -> None:
    """Until the engine reports `n` running requests (an event, not a sleep)."""
    deadline = time.monotonic() + timeout
    while server.metrics()["vllm:num_requests_running"] < n:
        assert time.monotonic() < deadline, f"never {n} running"
        time.sleep(0.05)


async def stream_until_error(client: httpx.AsyncClient, url: str) -> list[str]:
    """The data lines of one streamed completion, read to its end."""
    async with client.stream("POST", url, json={**LONG, "stream": True}) as r:
        assert r.status_code == 200
        return [line async for line in r.aiter_lines() if line]


async def fail_in_flight(server: RemoteServer, kill: bool) -> tuple[list[list[str]], httpx.Response]:
    """Three streamed and one plain request in flight when the engine fails (killed by us,
    or by its own injected fault); returns their streams and the plain response."""
    url = server.url("/v1/completions")
    async with httpx.AsyncClient(timeout=120) as client:
        streams = [asyncio.ensure_future(stream_until_error(client, url)) for _ in range(3)]
        plain = asyncio.ensure_future(client.post(url, json=LONG))
        if kill:
            await asyncio.to_thread(wait_running, server, 4)
            os.kill(server.engine_pid(), signal.SIGKILL)
        return await asyncio.gather(*streams), await plain


@pytest.mark.parametrize("kill", [True, False], ids=["sigkill", "worker-raises"])
def test_engine_failure_fails_requests_and_exits_non_zero(kill: bool, tmp_path) -> None:
    # A TMPDIR of its own: the IPC files seen are this server's, whatever else runs.
    tmp = str(tmp_path)
    # The faulty worker raises on its 60th forward: after the 4 requests are all running,
    # long before any of them (400 tokens) could finish. The grace period before the server
    # exits is long enough for the late requests below on a busy machine (2 s by default).
    server = RemoteServer([*SMALL_ENGINE_ARGS, *EAGER], module="tests.api_server.faulty_serve",
                          env={"JAXSERVE_TEST_FAIL_AT_STEP": "0" if kill else "60", "TMPDIR": tmp,
                               "JAXSERVE_TEST_DEAD_GRACE_S": "15"})
    try:
        assert ipc_files(tmp), "the server's IPC files exist while it runs"
        streams, plain = asyncio.run(fail_in_flight(server, kill))
        for lines in streams:
            assert lines[-1] == "data: [DONE]"
            assert '"error"' in lines[-2] and "engine core" in lines[-2], lines[-3:]
            assert '"code": 503' in lines[-2] or '"code":503' in lines[-2], lines[-2]
        assert plain.status_code == 503, plain.text
        assert "engine core" in plain.json()["error"]["message"]
        # New requests: 503 until the server exits (after a short grace period).
        late = httpx.post(server.url("/v1/completions"), json=LONG, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["type"] == "ServiceUnavailableError"
        assert httpx.get(server.url("/health"), timeout=30).status_code == 503
        assert server.proc.wait(timeout=180) == 1
        log = server.read_log()
        assert ("engine core process died" in log) if kill else ("injected fault on forward 60" in log)
        # Expected errors are answered, not logged as a crash of the application.
        assert "Exception in ASGI application" not in log, log[-3000:]
    finally:
        server.stop()
    assert not ipc_files(tmp), "IPC files left behind"
    assert process_gone(server.engine_pid())


def test_engine_startup_failure_exits_non_zero(tmp_path) -> None:
    # 100,000 tokens exceeds the model's context: the engine core refuses to start.
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.serve", "--port", "0", "--max-model-len", "100000",
         "--kv-cache-memory-bytes", str(256 << 20)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "engine core failed to start" in proc.stderr and "100000" in proc.stderr
    assert not ipc_files(str(tmp_path))


@pytest.mark.parametrize("how", ["sigterm", "api-server-raises"])
def test_an_exit_while_the_engine_loads_stops_it_and_removes_ipc_files(how: str, tmp_path) -> None:
    """SIGTERM (docker stop, systemd) before the server is ready, or an exception in the API
    server: the engine process is stopped and the IPC files are gone either way."""
    env = {"TMPDIR": str(tmp_path), "JAXSERVE_TEST_FAIL_API_SERVER": str(int(how != "sigterm"))}
    server = RemoteServer(SMALL_ENGINE_ARGS, module="tests.api_server.faulty_serve", env=env,
                          wait_healthy=False)
    try:
        if how == "sigterm":
            server.wait_for_log("is loading")
            assert ipc_files(str(tmp_path))
            server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout=180)
        log = server.read_log()
        assert code == (0 if how == "sigterm" else 1), log[-3000:]
        if how != "sigterm":
            assert "injected API server failure" in log
    finally:
        server.stop()
    assert not ipc_files(str(tmp_path)), "IPC files left behind"
    assert process_gone(server.engine_pid())


def test_bad_arguments_exit_before_starting_anything() -> None:
    for args in (["--model", "/no/such/model"], ["--block-size", "3"]):
        proc = subprocess.run([sys.executable, "-m", "jaxserve.serve", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_ctrl_c_ends_streams_cleanly_and_logs_stats(tmp_path) -> None:
    """SIGINT (Ctrl-C) with a stream in flight: the stream gets an error then [DONE], the
    server exits 0 without a traceback and removes its IPC files. While it runs, the periodic
    stats line is logged. The server runs with tracing off: it serves, and /debug has nothing
    to show. (SIGTERM while serving: test_server.py's module server.)"""
    server = RemoteServer([*SMALL_ENGINE_ARGS, "--no-request-tracing"],
                          env={"JAXSERVE_LOG_STATS_INTERVAL": "0.5", "TMPDIR": str(tmp_path)})
    try:
        assert ipc_files(str(tmp_path))
        r = server.client().completions.create(model="SmolLM2-135M-Instruct", prompt="Hi",
                                               max_tokens=3)
        assert r.choices[0].text
        assert httpx.get(server.url("/debug/requests"), timeout=10).json() == {"running": [], "finished": []}
        assert httpx.get(server.url(f"/debug/requests/{r.id}"), timeout=10).status_code == 404
        stats = httpx.get(server.url("/debug/stats"), timeout=10).json()
        assert stats["tracing"] is False and stats["live"]["num_steps"] == 0
        assert httpx.get(server.url("/debug"), timeout=10).status_code == 200
        with httpx.stream("POST", server.url("/v1/completions"), json={**LONG, "stream": True},
                          timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            server.wait_for_log("Avg generation throughput")
            server.proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2], rest[-3:]
        assert server.proc.wait(timeout=180) == 0
        log = server.read_log()
        assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
        # In a log file the compile progress is lines, never a bar's redraws.
        assert "Compiling programs: " in log and "%|" not in log
        assert "libtpu" not in log and "PyTorch was not found" not in log
    finally:
        server.stop()
    assert not ipc_files(str(tmp_path))
    assert process_gone(server.engine_pid())


def test_a_grammar_that_fails_mid_generation_ends_the_request_with_an_error() -> None:
    """A matcher that fails mid-generation (injected: after 3 tokens) ends its request with
    finish_reason "error" and the reason, a stream with an error event too, and a Responses
    stream with response.failed; an unconstrained request beside it is untouched and the
    server keeps serving."""
    server = RemoteServer([*SMALL_ENGINE_ARGS, *EAGER], module="tests.api_server.faulty_serve",
                          env={"JAXSERVE_TEST_FAIL_GRAMMAR_AFTER": "3"})
    try:
        grammar = {"prompt": "Digits:", "max_tokens": 12, "temperature": 0,
                   "structured_outputs": {"regex": "[0-9]{10}"}}
        r = httpx.post(server.url("/v1/completions"), json=grammar, timeout=60)
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and choice["finish_reason"] == "error", r.text
        assert "injected matcher failure" in choice["stop_reason"]
        assert len(choice["text"]) == 3 and choice["text"].isdigit()  # never unconstrained
        with httpx.stream("POST", server.url("/v1/completions"), json={**grammar, "stream": True},
                          timeout=60) as s:
            lines = [line for line in s.iter_lines() if line]
        assert '"finish_reason":"error"' in lines[-3].replace(" ", ""), lines[-3:]
        assert '"error"' in lines[-2] and "injected matcher failure" in lines[-2], lines[-2]
        assert lines[-1] == "data: [DONE]"
        with httpx.stream("POST", server.url("/v1/responses"), timeout=60, json={
                "input": "Digits:", "max_output_tokens": 12, "temperature": 0, "stream": True,
                "structured_outputs": {"regex": "[0-9]{10}"}}) as s:
            kinds = [json.loads(line[6:])["type"] for line in s.iter_lines()
                     if line.startswith("data: ")]
        assert kinds[-2:] == ["error", "response.failed"], kinds
        plain = httpx.post(server.url("/v1/completions"), timeout=60, json={
            "prompt": "Digits:", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert plain.json()["choices"][0]["finish_reason"] == "length"
    finally:
        server.stop()
