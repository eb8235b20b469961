"""The one codec for records crossing the ZeroMQ socket (jaxserve/engine_core/wire.py): every
record type the two processes exchange survives msgpack, nested records included, and a
record of the wrong shape is a ValueError naming its class and fields."""

from __future__ import annotations

import msgpack
import pytest

from jaxserve.config import KVCacheDtype, ResolvedConfig, WeightFormat
from jaxserve.engine.messages import EngineCoreRequest, EngineReady
from jaxserve.engine_core.spec_decode import SpecDecodingStats
from jaxserve.engine_core.stats import PrefixCacheStats, SchedulerStats, StepStats
from jaxserve.engine_core.step_trace import StepTrace
from jaxserve.engine_core.wire import decode_record, encode_record
from jaxserve.kv_cache_spec import KVCacheGroups
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

RECORDS = [
    EngineCoreRequest("r", [1, 2, 3], SamplingParams(temperature=0.5, stop=["x"], seed=9),
                      12.5, priority=3, cache_salt="s"),
    EngineCoreRequest("e", [4, 5], SamplingParams(max_tokens=1), 1.0,
                      pooling_params=PoolingParams("MEAN", normalize=False)),
    EngineReady(100, 16, 49152, 64, {"load_s": 1.5, "compile_s": 20.0},
                ResolvedConfig("cpu", "float32", WeightFormat.BF16_PACKED, "why", "cpu", 2048,
                               KVCacheDtype.FP8_E5M2,
                               kv_cache_groups=KVCacheGroups.for_layers([None, 8, 8, None]))),
    StepTrace(7, 1.0, 1.1, 4, 64, 1.2, 1.3, 1.5, 1.6, 0.01, 1, 0.5),
    SchedulerStats(3, 1, 0.25, PrefixCacheStats(2, 100, 40), 1,
                   StepStats(10, 0.02, 3.5, 1, 0.5), SpecDecodingStats(3, 4, 12, 7, [3, 2, 2]),
                   {"full_attention": 0.2, "sliding_window": 0.05}),
    SchedulerStats(),  # optional nested records absent
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_records_survive_msgpack(record) -> None:
    wire = msgpack.unpackb(msgpack.packb(encode_record(record)), raw=False)
    assert isinstance(wire, list)
    assert decode_record(type(record), wire) == record


def test_a_record_of_the_wrong_shape_names_its_class_and_fields() -> None:
    with pytest.raises(ValueError, match=r"a StepTrace record has 12 fields \(step, "):
        decode_record(StepTrace, [1, 2, 3])
    with pytest.raises(ValueError, match="EngineReady record"):
        decode_record(EngineReady, {"num_blocks": 1})
