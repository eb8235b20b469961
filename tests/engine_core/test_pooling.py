"""Embedding (pooling) requests in the engine core: scheduled like any prompt, ended by the
worker's vector with no token; MEAN and CLS skip the prefix cache, LAST uses it."""

from __future__ import annotations

import msgpack
import pytest

from jaxserve.engine.processor import POOLING_SAMPLING_PARAMS
from jaxserve.engine_core.core_outputs import EngineCoreOutput
from jaxserve.engine_core.request import Request
from jaxserve.engine_core.wire import decode_record, encode_record
from jaxserve.outputs import FinishReason
from jaxserve.pooling_params import PoolingParams

from .helpers import make_request, make_scheduler, model_output, schedule


def embed_request(req_id: str, prompt: list[int], pooling: str = "LAST") -> Request:
    return Request(req_id, prompt, POOLING_SAMPLING_PARAMS, eos_token_id=2,
                   pooling_params=PoolingParams(pooling))


def run(sched, vectors: dict[str, list[float]], max_steps: int = 50) -> dict[str, EngineCoreOutput]:
    """Steps until every request finished; the worker hands `vectors[r]` with r's last chunk."""
    done: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return done
        so = schedule(sched)
        out = model_output(sched, so, 7)
        out.pooler_output = {r: vectors[r] for r in so.num_scheduled_tokens
                             if r in vectors and so.samples[r]}  # type: ignore[attr-defined]
        for o in sched.update_from_output(so, out):
            assert o.req_id not in done
            if o.finished:
                done[o.req_id] = o
            if o.req_id in vectors:
                assert o.new_token_ids == [] and (o.pooling_output is None) != o.finished
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_embedding_request_ends_with_its_vector_and_no_token(async_scheduling: bool) -> None:
    sched = make_scheduler(max_num_batched_tokens=8, async_scheduling=async_scheduling)
    sched.add_request(embed_request("e", list(range(10, 30))))  # 20 tokens: 3 chunks
    sched.add_request(make_request("g", 6, max_tokens=4))  # generation beside it
    done = run(sched, {"e": [0.5, 0.25]})
    assert done["e"].finish_reason is FinishReason.STOP and done["e"].pooling_output == [0.5, 0.25]
    assert done["g"].finish_reason is FinishReason.LENGTH
    assert not sched.requests and sched.kv_cache_manager.usage == 0


@pytest.mark.parametrize("pooling, hit", [("LAST", True), ("MEAN", False), ("CLS", False)])
def test_only_last_pooling_reads_the_prefix_cache(pooling: str, hit: bool) -> None:
    sched = make_scheduler()
    prompt = list(range(100, 117))
    sched.add_request(make_request("warm", prompt=prompt, max_tokens=1))
    run(sched, {})
    sched.add_request(embed_request("e", prompt, pooling))
    so = schedule(sched)
    assert so.scheduled_new_reqs[0].num_computed_tokens == (16 if hit else 0)
    assert so.scheduled_new_reqs[0].pooling_params == PoolingParams(pooling)


def test_the_vector_survives_the_wire() -> None:
    out = EngineCoreOutput("e", [], finish_reason=FinishReason.STOP, pooling_output=[0.125, -2.0])
    wire = msgpack.unpackb(msgpack.packb(encode_record(out)), raw=False)
    assert decode_record(EngineCoreOutput, wire) == out
