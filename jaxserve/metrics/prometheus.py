"""Prometheus metrics under vLLM's names (`vllm:...`, its labels and buckets), so that vLLM's
Grafana dashboard, the production-stack router and llm-d's scheduler read jaxserve unchanged;
a metric vLLM lacks has a `jaxserve:` name. As in vLLM, every series carries `model_name` and
`engine` (the data-parallel engine's index): one series per engine, which queries sum.

Scheduler gauges and counters come from the engine process with each batch of
outputs (`SchedulerStats`); per-request latencies are built here from each
request's timestamps (vLLM's `RequestStateStats`):

    arrival ─ queued ─────── scheduled ──────── first token ────── last token
              │ queue time  │   prefill time    │   decode time    │
    │───── time to first token ─────────────────│
    │───── e2e latency ────────────────────────────────────────────│

Engine timestamps (queued, scheduled, first token, finished) and the API
server's share CLOCK_MONOTONIC, so they can be subtracted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from jaxserve.engine_core.core_outputs import EngineCoreEventType, EngineCoreOutput
from jaxserve.engine_core.stats import SchedulerStats, StepStats

PREFIX = "vllm:"
OWN_PREFIX = "jaxserve:"  # metrics vLLM has no name for

# vLLM's buckets.
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
_ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_N_BUCKETS = [1, 2, 5, 10, 20]


@dataclass
class RequestStateStats:
    """Timestamps of one engine request (time.monotonic() seconds)."""

    arrival_time: float
    num_prompt_tokens: int
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0  # engine side
    finished_ts: float = 0.0  # engine side
    last_token_time: float = 0.0  # API-server side
    num_generation_tokens: int = 0
    engine: int = 0  # the data-parallel engine that runs it


class _PerEngine:
    """One metric family's series, one per engine: `m[engine]` is engine `engine`'s. Each
    engine's series exists from the start (a gauge reads 0 before the first stats)."""

    def __init__(self, family: Any, model_name: str, num_engines: int) -> None:
        self.family, self.model_name = family, model_name
        for engine in range(num_engines):
            self[engine]

    def __getitem__(self, engine: int) -> Any:
        return self.family.labels(self.model_name, str(engine))


class ServerMetrics:
    """Every metric of one served model, in a registry of its own."""

    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        disable_created_metrics()  # no `*_created` series, as in vLLM
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name", "engine"]
        self._model_name = model_name
        self._engine_stats: dict[int, SchedulerStats] = {}  # latest, per data-parallel rank
        # Plain running totals beside the Prometheus counters, for the periodic log line and
        # /debug's live counters (prometheus_client has no public read API).
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0, "prefix_queries": 0,
                       "prefix_hits": 0, "preemptions": 0, "spec_drafts": 0,
                       "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        # For /debug: generated tokens as they came (monotonic time, count), and compiles as
        # they happened (Unix time, programs, seconds) from the engines' running totals.
        self._token_times: deque[tuple[float, int]] = deque()
        self._compiles: deque[tuple[float, int, float]] = deque(maxlen=1024)
        self._compile_totals: dict[int, tuple[int, float]] = {}

        def gauge(name: str, doc: str) -> _PerEngine:
            return _PerEngine(Gauge(PREFIX + name, doc, labels, registry=r), model_name, num_engines)

        def counter(name: str, doc: str) -> _PerEngine:
            return _PerEngine(Counter(PREFIX + name, doc, labels, registry=r), model_name,
                              num_engines)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> _PerEngine:
            return _PerEngine(Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r),
                              model_name, num_engines)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = 100%).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (pages taken back).")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        # Speculative decoding (vLLM's spec_decode_* counters).
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Requests' draft proposals verified.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.",
            ["model_name", "engine", "position"], registry=r)
        self._routed = Counter(OWN_PREFIX + "engine_requests_routed",
                               "Requests sent to each data-parallel engine.",
                               ["model_name", "engine"], registry=r)
        self._request_success = Counter(PREFIX + "request_success", "Finished requests by reason.",
                                        ["model_name", "engine", "finished_reason"], registry=r)
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two outputs of a request.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time in the waiting queue.", _LATENCY_BUCKETS)
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", _LATENCY_BUCKETS)
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS)
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to last token.", _LATENCY_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Decode time per output token.", _ITL_BUCKETS)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Output length of finished requests.", _TOKEN_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens per engine step (prompt tokens of requests that "
            "reached their first token, and generated tokens).", _ITERATION_BUCKETS)
        self.request_params_n = histogram("request_params_n", "The n request parameter.", _N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens request parameter.", _TOKEN_BUCKETS)
        self._cache_config = Gauge(PREFIX + "cache_config_info", "Information of the KV cache.",
                                   ["model_name", "engine", "block_size", "num_gpu_blocks",
                                    "cache_dtype", "enable_prefix_caching"], registry=r)
        self._iteration: dict[int, int] = {}  # tokens of each engine's step being recorded

    def record_cache_config(self, block_size: int, num_blocks: int, cache_dtype: str,
                            enable_prefix_caching: bool, num_engines: int = 1) -> None:
        """vLLM's info gauge (1, the facts in its labels), per engine; `num_gpu_blocks` is
        vLLM's name for the KV pages, whatever the device."""
        for engine in range(num_engines):
            self._cache_config.labels(self._model_name, str(engine), str(block_size),
                                      str(num_blocks), cache_dtype, str(enable_prefix_caching)).set(1)

    def record_request_params(self, n: int, max_tokens: int, engine: int = 0) -> None:
        self.request_params_n[engine].observe(n)
        self.request_params_max_tokens[engine].observe(max_tokens)

    def end_iteration(self, engine: int = 0) -> None:
        """One engine step's outputs have all been recorded."""
        if tokens := self._iteration.pop(engine, 0):
            self.iteration_tokens[engine].observe(tokens)

    # --- from the engine --------------------------------------------------------------

    def record_routed(self, engine_index: int) -> None:
        self._routed.labels(self._model_name, str(engine_index)).inc()

    def record_scheduler_stats(self, stats: SchedulerStats, engine_index: int = 0) -> None:
        """One engine's gauges and counters (its series); the running totals sum engines."""
        e = engine_index
        self._engine_stats[e] = stats
        self.num_requests_running[e].set(stats.num_running_reqs)
        self.num_requests_waiting[e].set(stats.num_waiting_reqs)
        self.kv_cache_usage_perc[e].set(stats.kv_cache_usage)
        self.prefix_cache_queries[e].inc(stats.prefix_cache_stats.queries)
        self.prefix_cache_hits[e].inc(stats.prefix_cache_stats.hits)
        self.totals["prefix_queries"] += stats.prefix_cache_stats.queries
        self.totals["prefix_hits"] += stats.prefix_cache_stats.hits
        self.num_preemptions[e].inc(stats.num_preemptions)
        spec = stats.spec_decoding_stats
        if spec is not None:
            self.spec_decode_num_drafts[e].inc(spec.num_drafts)
            self.spec_decode_num_draft_tokens[e].inc(spec.num_draft_tokens)
            self.spec_decode_num_accepted_tokens[e].inc(spec.num_accepted_tokens)
            self.totals["spec_drafts"] += spec.num_drafts
            self.totals["spec_draft_tokens"] += spec.num_draft_tokens
            self.totals["spec_accepted_tokens"] += spec.num_accepted_tokens
            for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                self._accepted_per_pos.labels(self._model_name, str(e), str(pos)).inc(n)
        self.totals["preemptions"] += stats.num_preemptions
        steps = stats.step_stats or StepStats()
        n, secs = steps.num_compiles, steps.compile_s
        n0, s0 = self._compile_totals.get(engine_index, (0, 0.0))
        if n > n0:
            self._compiles.append((time.time(), int(n - n0), secs - s0))
            self._compile_totals[engine_index] = (n, secs)

    def record_output(self, s: RequestStateStats, out: EngineCoreOutput, now: float) -> None:
        """One engine output of the request whose stats are `s`."""
        for event in out.events or ():
            if event.type == EngineCoreEventType.QUEUED and not s.queued_ts:
                s.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED and not s.scheduled_ts:
                s.scheduled_ts = event.timestamp
            elif event.type == EngineCoreEventType.FIRST_TOKEN and not s.first_token_ts:
                s.first_token_ts = event.timestamp
            elif event.type == EngineCoreEventType.FINISHED:
                s.finished_ts = event.timestamp
        n, e = len(out.new_token_ids), s.engine
        if out.pooling_output is not None:  # a pooling request: its prompt, no tokens
            self.prompt_tokens[e].inc(s.num_prompt_tokens)
            self.totals["prompt_tokens"] += s.num_prompt_tokens
        if not n:
            return
        self.generation_tokens[e].inc(n)
        self.totals["generation_tokens"] += n
        self._iteration[e] = self._iteration.get(e, 0) + n + (
            0 if s.num_generation_tokens else s.num_prompt_tokens)
        self._token_times.append((now, n))
        if s.num_generation_tokens == 0:
            self.prompt_tokens[e].inc(s.num_prompt_tokens)
            self.totals["prompt_tokens"] += s.num_prompt_tokens
            self.time_to_first_token[e].observe(now - s.arrival_time)
        else:
            self.inter_token_latency[e].observe(now - s.last_token_time)
        s.num_generation_tokens += n
        s.last_token_time = now

    def record_finished(self, s: RequestStateStats, finish_reason: str, now: float | None = None) -> None:
        """A request ended (`finish_reason` "stop", "length" or "abort")."""
        e = s.engine
        self._request_success.labels(self._model_name, str(e), finish_reason).inc()
        if finish_reason == "abort" or not s.num_generation_tokens:
            return
        now = time.monotonic() if now is None else now
        self.e2e_request_latency[e].observe(now - s.arrival_time)
        if s.queued_ts and s.scheduled_ts:
            self.request_queue_time[e].observe(max(s.scheduled_ts - s.queued_ts, 0.0))
        first_token = s.first_token_ts or s.last_token_time
        last_token = s.finished_ts or s.last_token_time
        if s.scheduled_ts:
            self.request_prefill_time[e].observe(max(first_token - s.scheduled_ts, 0.0))
            self.request_inference_time[e].observe(max(last_token - s.scheduled_ts, 0.0))
        decode = max(last_token - first_token, 0.0)
        self.request_decode_time[e].observe(decode)
        if s.num_generation_tokens > 1:
            self.request_time_per_output_token[e].observe(decode / (s.num_generation_tokens - 1))
        self.request_prompt_tokens[e].observe(s.num_prompt_tokens)
        self.request_generation_tokens[e].observe(s.num_generation_tokens)

    def running_waiting_usage(self) -> tuple[int, int, float]:
        latest = self._engine_stats.values()
        if not latest:
            return 0, 0, 0.0
        return (sum(s.num_running_reqs for s in latest), sum(s.num_waiting_reqs for s in latest),
                sum(s.kv_cache_usage for s in latest) / len(latest))

    def recent_compiles(self, since: float) -> tuple[int, float]:
        """Programs compiled while serving since `since` (Unix seconds), and their seconds."""
        recent = [(n, s) for t, n, s in self._compiles if t >= since]
        return sum(n for n, _ in recent), sum(s for _, s in recent)

    def tokens_per_s(self, window_s: float = 10.0, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._token_times and self._token_times[0][0] < now - window_s:
            self._token_times.popleft()
        return sum(n for _, n in self._token_times) / window_s

    def live(self) -> dict[str, Any]:
        """/debug's live counters: the engines' latest stats (summed over data-parallel ranks;
        KV usage and step figures averaged), prefix-hit rate, preemptions, tokens/s."""
        running, waiting, usage = self.running_waiting_usage()
        engines = list(self._engine_stats.values())
        by_kind = {kind: sum(s.kv_cache_usage_by_kind.get(kind, 0.0) for s in engines) / len(engines)
                   for kind in ("full_attention", "sliding_window", "recurrent_state")
                   if any(kind in s.kv_cache_usage_by_kind for s in engines)}
        steps = [s.step_stats for s in self._engine_stats.values() if s.step_stats]
        k = max(len(steps), 1)
        queries, hits = self.totals["prefix_queries"], self.totals["prefix_hits"]
        return {
            "waiting": waiting, "running": running, "kv_cache_usage": usage,
            # Which kind of layers holds the pages (a hybrid model's: both kinds).
            "kv_cache_usage_full_attention": by_kind.get("full_attention"),
            "kv_cache_usage_sliding_window": by_kind.get("sliding_window"),
            # A Gated DeltaNet hybrid's linear layers: the share of its state slots in use.
            "state_slot_usage": by_kind.get("recurrent_state"),
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "num_preemptions": self.totals["preemptions"],
            "num_steps": sum(x.num_steps for x in steps),
            "step_time_s": sum(x.step_time_s for x in steps) / k,
            "batch_size": sum(x.batch_size for x in steps) / k,
            "num_compiles": sum(x.num_compiles for x in steps),
            "compile_s": sum(x.compile_s for x in steps),
            "tokens_per_s": self.tokens_per_s(),
        }

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class LoggingStatLogger:
    """vLLM's periodic log line: throughputs since the previous line, the batch, KV usage
    and the prefix-cache hit rate. `line()` returns None while the server is idle."""

    def __init__(self, metrics: ServerMetrics, now: float | None = None) -> None:
        self.metrics = metrics
        self._last = dict(metrics.totals)
        self._last_time = time.monotonic() if now is None else now
        self._was_idle = True

    def line(self, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        totals, dt = dict(self.metrics.totals), max(now - self._last_time, 1e-9)
        delta = {k: totals[k] - self._last[k] for k in totals}
        self._last, self._last_time = totals, now
        running, waiting, usage = self.metrics.running_waiting_usage()
        idle = not (running or waiting or delta["prompt_tokens"] or delta["generation_tokens"])
        if idle and self._was_idle:
            return None  # one line after the work stops, then quiet
        self._was_idle = idle
        queries, hits = totals["prefix_queries"], totals["prefix_hits"]
        line = (f"Avg prompt throughput: {delta['prompt_tokens'] / dt:.1f} tokens/s, "
                f"Avg generation throughput: {delta['generation_tokens'] / dt:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {usage * 100:.1f}%, "
                f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")
        drafts, drafted = delta["spec_drafts"], delta["spec_draft_tokens"]
        if drafts:  # vLLM's SpecDecoding metrics, since the previous line
            accepted = delta["spec_accepted_tokens"]
            line += (f", SpecDecoding: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                     f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                     f"Draft acceptance rate: {100 * accepted / drafted:.1f}%")
        return line
