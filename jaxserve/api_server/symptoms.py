"""Symptom -> box: recent traces and live counters read against the map of docs/architecture.md.

    slow time-to-first-token, spent queueing      -> scheduler          (more seqs / tokens per
                                                                         step, or DP ranks)
    long prompts prefilled over many steps        -> scheduler          (chunk size)
    programs compiled while serving / eager mode  -> model_runner       (warm-up, buckets)
    preemptions, a full KV cache                   -> kv_cache_manager   (KV memory, fewer seqs)
    tokens waiting in the API server              -> api_server         (event loop, streams)

Each finding: {"symptom", "box", "evidence", "advice"}; none when healthy or idle.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from jaxserve.metrics.prometheus import ServerMetrics
from jaxserve.metrics.trace_store import TraceStore

WINDOW_S = 60.0  # findings come from requests that finished in the last minute, or live ones
COMPILE_S = 0.5  # seconds of compiling in that minute that count as a symptom


@dataclass(frozen=True)
class ServerFacts:
    """What the advice refers to: the flags the server runs with."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enforce_eager: bool = False
    data_parallel_size: int = 1


def _finding(symptom: str, box: str, evidence: str, advice: str) -> dict[str, str]:
    return {"symptom": symptom, "box": box, "evidence": evidence, "advice": advice}


def diagnose(store: TraceStore, metrics: ServerMetrics, facts: ServerFacts,
             now: float | None = None) -> list[dict[str, str]]:
    now = time.time() if now is None else now
    traces = store.recent(now - WINDOW_S) + list(store.running.values())
    summaries = [t.summary() for t in traces]
    live = metrics.live()
    findings = []

    # scheduler: time to first token spent waiting for a slot.
    waited = [s for s in summaries if s["ttft_s"] and s["queue_s"] > 0.25
              and s["queue_s"] > 0.5 * s["ttft_s"]]
    queue_full = live["waiting"] > 0 and live["running"] >= facts.max_num_seqs * facts.data_parallel_size
    if (summaries and len(waited) >= max(2, len(summaries) // 4)) or queue_full:
        med = statistics.median(s["queue_s"] for s in waited) if waited else 0.0
        ttft = statistics.median(s["ttft_s"] for s in waited) if waited else 0.0
        findings.append(_finding(
            "time to first token dominated by queue wait", "scheduler",
            f"{len(waited)} of {len(summaries)} recent requests spent over half their TTFT "
            f"queued (median {med:.2f} s of {ttft:.2f} s); now {live['waiting']} waiting, "
            f"{live['running']} running with --max-num-seqs {facts.max_num_seqs}",
            f"raise --max-num-seqs (now {facts.max_num_seqs}) or --max-num-batched-tokens "
            f"(now {facts.max_num_batched_tokens}) if the KV cache has room, or add data-parallel "
            "ranks (--data-parallel-size)"))

    # scheduler: long prompts cut into many chunks.
    chunky = [s for s in summaries if s["prefill_steps"] >= 4 and s["ttft_s"] and s["ttft_s"] > 1.0]
    if chunky:
        findings.append(_finding(
            "long prompts prefilled over many steps", "scheduler",
            f"{len(chunky)} recent requests took >= 4 prefill steps (up to "
            f"{max(s['prefill_steps'] for s in chunky)}) for TTFTs over 1 s",
            f"raise --max-num-batched-tokens (now {facts.max_num_batched_tokens}) so a prompt "
            "needs fewer chunks"))

    # model_runner: compiling while serving (a first-use variant compiling in 0.1 s once is
    # not a symptom; seconds of it in a minute are).
    # (The engines' own compile deltas: a step's compile shows in every trace of its batch.)
    n_compiles, compile_s = metrics.recent_compiles(now - WINDOW_S)
    compiled = [s for s in summaries if s["compile_s"] > 0]
    if compile_s >= COMPILE_S:
        findings.append(_finding(
            "decode slowed by compilation", "model_runner",
            f"{n_compiles} programs compiled while serving in the last minute ({compile_s:.1f} s); "
            f"{len(compiled)} recent requests had a step that compiled"
            + ("; the server runs with --enforce-eager (no warm-up)" if facts.enforce_eager else ""),
            "drop --enforce-eager so every shape bucket compiles at start-up"
            if facts.enforce_eager else
            "a program not compiled at warm-up ran (a shape outside the buckets, or a first-use "
            "variant: grammar mask, prompt logprobs): check --max-num-batched-tokens / "
            "--max-num-seqs, and keep the persistent compilation cache"))

    # kv_cache_manager: preemptions or a full cache; with sliding-window layers, which kind
    # of layers holds the pages says which remedy helps.
    preempted = [s for s in summaries if s["num_preemptions"]]
    if preempted or live["kv_cache_usage"] > 0.95:
        sliding = live.get("kv_cache_usage_sliding_window")
        full = live.get("kv_cache_usage_full_attention") or 0.0
        evidence = (f"{len(preempted)} recent requests were preempted "
                    f"({sum(s['num_preemptions'] for s in preempted)} times); KV usage now "
                    f"{100 * live['kv_cache_usage']:.0f}%")
        if sliding is None:
            kind, advice = "", ("give the KV cache more memory (--kv-cache-memory-bytes or "
                                "--gpu-memory-utilization), lower --max-num-seqs, or shorten "
                                "--max-model-len")
        else:
            evidence += (f" (full-attention layers' pages {100 * full:.0f}%, sliding-window "
                         f"layers' {100 * sliding:.0f}%)")
            if sliding > full:
                kind, advice = " by sliding-window layers", (
                    "each running request holds its window's pages whatever its length: lower "
                    "--max-num-seqs, or give the KV cache more memory (--kv-cache-memory-bytes "
                    "or --gpu-memory-utilization)")
            else:
                kind, advice = " by full-attention layers", (
                    "long contexts hold the pages: shorten --max-model-len or give the KV cache "
                    "more memory (--kv-cache-memory-bytes or --gpu-memory-utilization)")
        findings.append(_finding(
            f"KV cache full{kind}: requests preempted and recomputed", "kv_cache_manager",
            evidence, advice))

    # kv_cache_manager, a hybrid's state pool: its slots are sized for --max-num-seqs running
    # requests (and as many kept states, which give way first), so a full pool is its own
    # remedy, not the pages'.
    states = live.get("state_slot_usage")
    if states is not None and states > 0.95:
        findings.append(_finding(
            "linear-attention state slots full", "kv_cache_manager",
            f"{100 * states:.0f}% of the state slots are held (each running request holds one "
            "per linear layer group, two in a step that starts a kept block)",
            "the pool is sized from --max-num-seqs: raise it, or keep fewer states for the "
            "prefix cache (a larger --mamba-block-size, or --mamba-cache-mode none)"))

    # api_server: tokens reached the engine's output long before the API server handled them.
    lags = [lag for t in traces if (lag := _output_lag(t)) is not None]
    slow = [x for x in lags if x > 0.25]
    if slow and len(slow) >= max(1, len(lags) // 4):
        findings.append(_finding(
            "stalls in detokenizing / streaming", "api_server",
            f"{len(slow)} recent requests waited over 0.25 s between their first token leaving "
            f"the engine core and the API server handling it (worst {max(slow):.2f} s)",
            "the API server's event loop is busy: fewer concurrent streams per server, smaller "
            "n / logprobs, or more data-parallel API servers"))
    return findings


def _output_lag(trace: Any) -> float | None:
    engine = [e.start for e in trace.events if e.box == "engine_core" and e.name == "first_token"]
    front = [e.end for e in trace.events if e.box == "output_processor" and e.name == "first_token"]
    return front[0] - engine[0] if engine and front else None
