"""Start `python -m jaxserve.serve` as a subprocess on a free port (vLLM's RemoteOpenAIServer)."""

from __future__ import annotations

import glob
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The settings of the end-to-end tests (and of the in-process LLM they compare with).
SMALL_ENGINE_ARGS = ["--max-model-len", "512", "--max-num-seqs", "16",
                     "--kv-cache-memory-bytes", str(256 << 20)]
# As vLLM's own tests run its servers: a test's server compiles the programs its requests use,
# on first use, not every bucket's at start. The warm-up is what the servers without it test
# (test_engine_death's Ctrl-C and load tests, test_debug's symptoms) and
# tests/worker/test_llm_default_model.py's "nothing compiles after warm-up".
EAGER = ["--enforce-eager"]


def ipc_files(tmpdir: str | None = None) -> set[str]:
    """The ZeroMQ socket files of the jaxserve servers whose TMPDIR is `tmpdir`."""
    base = os.path.join(tmpdir or tempfile.gettempdir(), "jaxserve-")
    return set(glob.glob(base + "*-in")) | set(glob.glob(base + "*-out"))


def process_gone(pid: int) -> bool:
    """No such process, or only its zombie (a container's init may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """A running server; `stop()` (or the context manager) ends it."""

    def __init__(self, args: list[str], start_timeout: float = 240.0,
                 module: str = "jaxserve.serve", env: dict[str, str] | None = None,
                 api_key: str = "EMPTY", wait_healthy: bool = True) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="jaxserve-server-", suffix=".log",
                                               delete=False)
        self._final_log: str | None = None
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(self.port),
             "--disable-uvicorn-access-log", *args],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.base_url = f"http://127.0.0.1:{self.port}"
        if wait_healthy:
            self._wait_until_healthy(start_timeout)

    def _wait_until_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.read_log()}")

    def url(self, path: str) -> str:
        return self.base_url + path

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url("/v1"), api_key=self.api_key, max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url("/v1"), api_key=self.api_key, max_retries=0, **kw)

    def read_log(self) -> str:
        if self._final_log is not None:
            return self._final_log
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def wait_for_log(self, text: str, timeout: float = 240.0) -> str:
        """Until `text` is in the log (an event, not a sleep); returns the log."""
        deadline = time.monotonic() + timeout
        while text not in (log := self.read_log()):
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{log}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout} s:\n{log}"
            time.sleep(0.05)
        return log

    def engine_pid(self) -> int:
        m = re.search(r"engine core process \d+ \(pid (\d+)\)", self.read_log())
        assert m, self.read_log()
        return int(m.group(1))

    def metrics(self) -> dict[str, float]:
        """Every unlabelled-by-bucket sample of /metrics, keyed by name (labels dropped)."""
        text = httpx.get(self.url("/metrics"), timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            if name.endswith("_bucket"):
                continue
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)  # a clean shutdown, on a busy machine too
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._final_log is None:  # kept in memory: no log file left in $TMPDIR per server
            self._final_log = self.read_log()
            self.log.close()
            os.unlink(self.log.name)
        return self.proc.returncode

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_idle(server: RemoteServer, timeout: float = 60.0) -> dict[str, float]:
    """Until no request runs or waits and no KV page is in use (an event, not a sleep);
    returns the metrics then. Fails naming them after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                and m["vllm:kv_cache_usage_perc"] == 0):
            return m
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {m}"
        time.sleep(0.05)
