"""Scheduler and prefix-cache statistics, sampled by the engine loop for metrics.

Counters are deltas since the previous snapshot (the metrics side adds them to
Prometheus counters); gauges are instantaneous.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jaxserve.engine_core.spec_decode import SpecDecodingStats


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the previous snapshot.

    A query is counted once per admission of a request (also after a
    preemption), in tokens; `hits` are the tokens found in the cache.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class SchedulerStats:
    """One snapshot of the scheduler for the metrics endpoint and logs."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of pages in use, 0..1
    prefix_cache_stats: PrefixCacheStats = dataclasses.field(default_factory=PrefixCacheStats)
    num_preemptions: int = 0  # since the previous snapshot
    # StepTracer.stats(): num_steps, step_time_s, batch_size, num_compiles, compile_s
    step_stats: dict[str, float] = dataclasses.field(default_factory=dict)
    spec_decoding_stats: SpecDecodingStats | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SchedulerStats:
        d = dict(d)
        d["prefix_cache_stats"] = PrefixCacheStats(**d["prefix_cache_stats"])
        if d.get("spec_decoding_stats") is not None:
            d["spec_decoding_stats"] = SpecDecodingStats(**d["spec_decoding_stats"])
        return cls(**d)
