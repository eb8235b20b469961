"""/debug end to end: a request's trace box by box, diagnose naming the box of a symptom, the
page in a real headless browser (Debian's chromium), and the same spans over OTLP."""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time

import httpx
import pytest

from .server_utils import ROOT, SMALL_ENGINE_ARGS, RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BOXES = {"api_server", "engine_core", "scheduler", "kv_cache_manager", "model_runner", "sampler",
         "output_processor"}
CHROMIUM = shutil.which("chromium")


class Collector(http.server.ThreadingHTTPServer):
    """A minimal OTLP/HTTP trace receiver: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        outer.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def server(collector: Collector):
    # Two sequences at a time: 16 concurrent requests must queue (the scheduler's symptom).
    args = [*SMALL_ENGINE_ARGS, "--max-num-seqs", "2", "--otlp-traces-endpoint",
            f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"]
    with RemoteServer(args, env={"OTEL_BSP_SCHEDULE_DELAY": "100"}) as s:
        yield s


def get(server: RemoteServer, path: str) -> dict:
    r = httpx.get(server.url(path), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_an_idle_server_has_no_findings(server: RemoteServer) -> None:
    assert get(server, "/debug/diagnose") == {"findings": []}
    out = subprocess.run([sys.executable, "-m", "jaxserve.diagnose", "--url", server.base_url],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "healthy" in out.stdout


def test_a_chat_request_is_traced_through_every_box(server: RemoteServer, collector: Collector) -> None:
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about the sea. " * 30}],
        max_tokens=6, temperature=0)
    t = get(server, f"/debug/requests/{r.id}")
    assert t["id"] == r.id
    events = t["events"]
    assert [e["start"] for e in events] == sorted(e["start"] for e in events)
    assert all(e["end"] >= e["start"] for e in events)
    assert {e["box"] for e in events} == BOXES
    api = [e["name"] for e in events if e["box"] == "api_server"]
    assert api[:3] == ["received", "chat_template", "tokenize"] and "respond" in api
    steps = [e for e in events if e["box"] == "scheduler" and e["name"] == "schedule"]
    assert steps[0]["kind"] == "prefill" and steps[0]["tokens"] == r.usage.prompt_tokens
    assert [s["kind"] for s in steps[1:]] == ["decode"] * 5
    s = t["summary"]
    assert s["prompt_tokens"] == r.usage.prompt_tokens and s["output_tokens"] == 6
    assert s["status"] == "finished" and s["finish_reason"] == "length"
    assert 0 < s["ttft_s"] <= s["e2e_s"] and s["num_compiles"] == 0
    assert set(s["time_by_box"]) == BOXES
    listed = get(server, "/debug/requests")
    assert r.id in [x["id"] for x in listed["finished"]]
    missing = httpx.get(server.url("/debug/requests/chatcmpl-nope"), timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "request_id"
    # The same request reached the OTLP collector as a root span with one child per event.
    deadline = time.monotonic() + 30
    while not [x for x in collector.spans if x.name == "llm_request" and
               any(a.key == "gen_ai.response.id" and a.value.string_value == r.id for a in x.attributes)]:
        assert time.monotonic() < deadline, "no span reached the collector"
        time.sleep(0.1)
    [root] = [x for x in collector.spans if x.name == "llm_request" and
              any(a.value.string_value == r.id for a in x.attributes)]
    children = [x for x in collector.spans if x.parent_span_id == root.span_id]
    assert len(children) == len(events)
    assert {x.name.split(".")[0] for x in children} == BOXES


def test_a_completion_with_two_prompts_is_one_trace_per_prompt(server: RemoteServer) -> None:
    r = server.client().completions.create(model=MODEL, prompt=["One two", "Three four five"],
                                           max_tokens=3, temperature=0)
    t = get(server, f"/debug/requests/{r.id}")
    assert [p["prompt"] for p in t["summary"]["prompts"]] == [0, 1]
    assert {e["prompt"] for e in t["events"]} == {0, 1}


def _concurrent_completions(server: RemoteServer, n: int, max_tokens: int) -> list:
    client = server.client()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(client.completions.create, model=MODEL, prompt=f"Count to ten: {i}",
                               max_tokens=max_tokens, temperature=0) for i in range(n)]
        return [f.result() for f in futures]


def test_queueing_is_the_schedulers_symptom(server: RemoteServer) -> None:
    _concurrent_completions(server, 16, 24)
    findings = get(server, "/debug/diagnose")["findings"]
    assert "scheduler" in [f["box"] for f in findings], findings
    [f] = [f for f in findings if f["box"] == "scheduler" and "queue" in f["symptom"]]
    assert "--max-num-seqs" in f["advice"]
    out = subprocess.run([sys.executable, "-m", "jaxserve.diagnose", "--url", server.base_url],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "[scheduler]" in out.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (scripts/test.sh installs it)")
def test_the_page_in_a_headless_browser(server: RemoteServer, tmp_path) -> None:
    from playwright.sync_api import sync_playwright

    r = server.client().completions.create(model=MODEL, prompt="The sea is", max_tokens=8)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.goto(server.url("/debug"))
            # The map: every box drawn, its live numbers filled in.
            assert set(page.eval_on_selector_all("[data-box]", "els => els.map(e => e.dataset.box)")) \
                == BOXES - {"engine_core", "output_processor"}
            page.wait_for_function(
                "document.querySelector('[data-counter=num_steps]').textContent !== '–'")
            steps = int(page.text_content("[data-counter=num_steps]"))
            assert steps >= get(server, "/debug/stats")["live"]["num_steps"] - 50 > 0
            # A selected request's waterfall: bars in every box it passed.
            row = page.locator(f"#requests tr[data-id='{r.id}-0']")
            row.wait_for()
            row.click()
            page.wait_for_selector("#waterfall rect.bar")
            drawn = page.eval_on_selector_all("#waterfall rect.bar", "els => els.map(e => e.dataset.box)")
            assert set(drawn) == BOXES
            assert r.id in page.text_content("#wf-title")
            shot = page.screenshot(path=str(tmp_path / "debug.png"), full_page=True)
        finally:
            browser.close()
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", shot[16:24])
    assert width == 1100 and height >= 700
    if os.environ.get("JAXSERVE_SAVE_SCREENSHOT"):  # how docs/debug-page.png was made
        (open(os.environ["JAXSERVE_SAVE_SCREENSHOT"], "wb")).write(shot)


@pytest.fixture(scope="module")
def eager_server(tmp_path_factory):
    # A cold compilation cache: from a warm one the eager programs load in well under the
    # symptom's 0.5 s a minute (a cache hit is not a compile the user waits for).
    cache = str(tmp_path_factory.mktemp("jax_compilation_cache"))
    with RemoteServer([*SMALL_ENGINE_ARGS, "--enforce-eager"],
                      env={"JAX_COMPILATION_CACHE_DIR": cache}) as s:
        yield s


def test_compiling_while_serving_is_the_model_runners_symptom(eager_server: RemoteServer) -> None:
    assert get(eager_server, "/debug/diagnose") == {"findings": []}
    client = eager_server.client()
    for prompt in ("Hi", "A longer prompt, with more tokens in it than the first one had"):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
    findings = get(eager_server, "/debug/diagnose")["findings"]
    [f] = [f for f in findings if f["box"] == "model_runner"]
    assert "--enforce-eager" in f["evidence"] and "compil" in f["symptom"]
    assert get(eager_server, f"/debug/requests/{r.id}")["summary"]["num_compiles"] > 0
    assert json.dumps(findings)  # plain JSON
