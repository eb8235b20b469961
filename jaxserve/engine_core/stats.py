"""Scheduler and prefix-cache statistics, sampled by the engine loop for metrics.

Counters are deltas since the previous snapshot (the metrics side adds them to
Prometheus counters); gauges are instantaneous.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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
class StepStats:
    """The engine's step counters (StepTracer.stats()): steps so far, mean time between the
    recent steps and their mean batch size, programs compiled while serving."""

    num_steps: int = 0
    step_time_s: float = 0.0
    batch_size: float = 0.0
    num_compiles: int = 0
    compile_s: float = 0.0


@dataclass
class SchedulerStats:
    """One snapshot of the scheduler for the metrics endpoint and logs."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of pages in use, 0..1
    prefix_cache_stats: PrefixCacheStats = dataclasses.field(default_factory=PrefixCacheStats)
    num_preemptions: int = 0  # since the previous snapshot
    step_stats: StepStats | None = None  # None with request tracing off
    spec_decoding_stats: SpecDecodingStats | None = None
    # kv_cache_usage split by the kind of KV cache group holding the pages ("full_attention",
    # "sliding_window"); they add up to kv_cache_usage.
    kv_cache_usage_by_kind: dict[str, float] = dataclasses.field(default_factory=dict)
