"""Host-only tests of the ZeroMQ path: the engine-core busy loop with a fake worker
in a thread, the message encoding, and that the API server never imports JAX."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid

import msgpack
import pytest
import zmq

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.core_process import EngineCoreProc
from jaxserve.engine.messages import (
    EngineCoreMessageType,
    EngineCoreRequest,
    EngineCoreRequestType,
    RequestError,
    decode,
    encode,
)
from jaxserve.engine_core.core import EngineCore
from jaxserve.engine_core.core_outputs import EngineCoreOutput
from jaxserve.engine_core.model_runner_output import ModelRunnerOutput
from jaxserve.engine_core.request import InvalidRequestError
from jaxserve.engine_core.sched_output import SchedulerOutput
from jaxserve.engine_core.scheduler import Scheduler
from jaxserve.engine_core.stats import SchedulerStats
from jaxserve.engine_core.wire import decode_record, encode_record
from jaxserve.sampling_params import SamplingParams
from tests.api_server.server_utils import ROOT

TOKEN = 7


class OneTokenWorker:
    """Samples TOKEN for every scheduled request (prompts fit one step)."""

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [[TOKEN] for _ in ids])


@pytest.fixture
def engine():
    """(send, recv) to an EngineCoreProc running in a thread over inproc sockets."""
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                         async_scheduling=False)
    core = EngineCore(Scheduler(sc, CacheConfig(block_size=4), num_blocks=64, eos_token_id=2),
                      OneTokenWorker())
    ctx = zmq.Context()
    name = uuid.uuid4().hex
    to_engine, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_engine.bind(f"inproc://{name}-in")
    from_engine.bind(f"inproc://{name}-out")
    engine_in, engine_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    engine_in.connect(f"inproc://{name}-in")
    engine_out.connect(f"inproc://{name}-out")
    proc = EngineCoreProc(core, engine_in, engine_out, parent_pid=os.getppid())
    thread = threading.Thread(target=proc.run_busy_loop, daemon=True)
    thread.start()

    def send(kind: EngineCoreRequestType, payload) -> None:
        to_engine.send(encode(kind, payload))

    def recv(timeout_ms: int = 5000) -> tuple[int, object]:
        assert from_engine.poll(timeout_ms), "no message from the engine core"
        return decode(from_engine.recv())

    yield send, recv, proc
    send(EngineCoreRequestType.SHUTDOWN, None)
    thread.join(5)
    assert not thread.is_alive()
    for s in (to_engine, from_engine, engine_in, engine_out):
        s.close(linger=0)
    ctx.term()


def add(req_id: str, n_prompt: int = 5, **params) -> list:
    return encode_record(EngineCoreRequest(req_id, list(range(10, 10 + n_prompt)),
                                         SamplingParams(**params), time.monotonic()))


def collect(recv, until_finished: set[str]) -> tuple[dict[str, list[int]], SchedulerStats]:
    tokens: dict[str, list[int]] = {}
    stats = None
    while until_finished:
        kind, payload = recv()
        assert kind == EngineCoreMessageType.OUTPUTS
        stats = decode_record(SchedulerStats, payload["stats"])
        for d in payload["outputs"]:
            out = decode_record(EngineCoreOutput, d)
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finished:
                until_finished.discard(out.req_id)
    return tokens, stats


def test_add_generates_and_reports_stats(engine) -> None:
    send, recv, _ = engine
    send(EngineCoreRequestType.ADD, [add("a", max_tokens=3), add("b", max_tokens=5)])
    tokens, _ = collect(recv, {"a", "b"})
    assert tokens == {"a": [TOKEN] * 3, "b": [TOKEN] * 5}
    # Going idle, the loop sends the final gauges: nothing running, no pages held.
    kind, payload = recv()
    stats = decode_record(SchedulerStats, payload["stats"])
    assert kind == EngineCoreMessageType.OUTPUTS and payload["outputs"] == []
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0


def test_abort_frees_pages_and_bad_requests_are_reported(engine) -> None:
    send, recv, _ = engine
    send(EngineCoreRequestType.ADD, [add("long", max_tokens=50, ignore_eos=True),
                                     add("too-long", n_prompt=80)])
    kind, payload = recv()
    assert kind == EngineCoreMessageType.REQUEST_ERRORS
    (err,) = (decode_record(RequestError, v) for v in payload)
    assert err.req_id == "too-long" and "80 tokens" in err.message
    assert err.own_fault is True  # the request's own fault: a 400, not a 500
    send(EngineCoreRequestType.ABORT, ["long"])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        kind, payload = recv()
        stats = decode_record(SchedulerStats, payload["stats"])
        if payload["outputs"] == [] and stats.num_running_reqs == 0:
            break
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0


def test_request_round_trips_through_msgpack() -> None:
    params = SamplingParams(n=1, temperature=0.5, stop=["x", "yz"], stop_token_ids=[3], seed=9,
                            logprobs=2, top_k=5)
    req = EngineCoreRequest("r", [1, 2, 3], params, 12.5, priority=3, cache_salt="s")
    frame = encode(EngineCoreRequestType.ADD, [encode_record(req)])
    kind, payload = decode(frame)
    assert kind == EngineCoreRequestType.ADD
    assert EngineCoreRequest.decode(payload[0]) == req
    assert isinstance(msgpack.unpackb(frame), list)
    # A record of the wrong length names its class and fields; bad parameters are the
    # request's fault.
    with pytest.raises(InvalidRequestError, match=r"EngineCoreRequest record has 7 fields"):
        EngineCoreRequest.decode(payload[0][:5])
    bad = encode_record(req)
    bad[2][4] = -1.0  # temperature
    with pytest.raises(InvalidRequestError, match="temperature"):
        EngineCoreRequest.decode(bad)


def test_api_server_imports_without_jax() -> None:
    code = (
        "import sys\n"
        "import jaxserve.api_server.app, jaxserve.api_server.server, jaxserve.engine.core_process\n"
        "import jaxserve.bench.online\n"
        "from jaxserve.engine.arg_utils import engine_config_from_args\n"
        "from jaxserve.serve import make_arg_parser\n"
        "engine_config_from_args(make_arg_parser().parse_args(['--max-model-len', '512']))\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'jax', 'jaxlib', 'flax'})\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
