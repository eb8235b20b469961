"""Host time of one engine-core step: scheduler.schedule() + update_from_output().

The worker is replaced by a prebuilt ModelRunnerOutput (its construction is not
timed): this measures only what the engine core adds to every step. Target:
under 1 ms per step at 256 running requests, growing linearly.

    python scripts/bench_scheduler.py [--steps 300] [--kv-groups gemma3]

`--kv-groups gemma3`: Gemma 3's KV cache groups (one full-attention group, six sliding-window
ones, a 128-token window so decoding passes it): each step then also gives pages back.
"""

from __future__ import annotations

import argparse
import statistics
import time

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine_core.core import freeze_gc_heap
from jaxserve.engine_core.model_runner_output import ModelRunnerOutput
from jaxserve.engine_core.request import Request
from jaxserve.engine_core.sched_output import SchedulerOutput
from jaxserve.engine_core.scheduler import Scheduler
from jaxserve.kv_cache_spec import FULL_ATTENTION, KVCacheGroups
from jaxserve.sampling_params import SamplingParams

BLOCK_SIZE = 16
# CPU time of this thread: on a shared machine the wall clock also counts the
# time other processes hold the core (multi-millisecond OS time slices).
CLOCKS = [time.thread_time_ns]
FREEZE_GC = [True]
GROUPS = [FULL_ATTENTION]
GEMMA3 = KVCacheGroups.for_layers([None if (i + 1) % 6 == 0 else 128 for i in range(34)])


def fake_output(sched: Scheduler, so: SchedulerOutput, step: int) -> ModelRunnerOutput:
    """One token for each request whose chunk reached the end of its tokens."""
    req_ids = list(so.num_scheduled_tokens)
    requests = sched.requests
    sampled = [
        [1000 + (step + i) % 3000]
        if requests[r].num_computed_tokens >= requests[r].num_tokens
        else []
        for i, r in enumerate(req_ids)
    ]
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def make_scheduler(num_running: int, budget: int, max_model_len: int, num_blocks: int,
                   async_scheduling: bool, caching: bool) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=num_running + 8, max_num_batched_tokens=budget,
                        max_model_len=max_model_len, async_scheduling=async_scheduling),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching),
        num_blocks=num_blocks * len(GROUPS[0].groups),
        eos_token_id=2,
        kv_cache_groups=GROUPS[0],
    )


def add(sched: Scheduler, req_id: str, prompt_len: int, max_tokens: int) -> None:
    prompt = [10 + (hash(req_id) + i) % 30000 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sched.add_request(Request(req_id, prompt, params))


def run(sched: Scheduler, steps: int, on_step=None) -> tuple[list[float], list[float], float]:
    """Time `steps` steps; returns per-step CPU ms, wall ms and mean tokens per step."""
    cpu, wall, tokens = [], [], 0
    clock = CLOCKS[0]
    if FREEZE_GC[0]:
        freeze_gc_heap()  # as a dedicated engine-core process does at start-up
    for i in range(steps):
        if on_step:
            on_step(i)
        c0, t0 = clock(), time.perf_counter_ns()
        so = sched.schedule()
        c1, t1 = clock(), time.perf_counter_ns()
        out = fake_output(sched, so, i)  # the worker's part: not timed
        c2, t2 = clock(), time.perf_counter_ns()
        sched.update_from_output(so, out)
        c3, t3 = clock(), time.perf_counter_ns()
        cpu.append(((c1 - c0) + (c3 - c2)) / 1e6)
        wall.append(((t1 - t0) + (t3 - t2)) / 1e6)
        tokens += so.total_num_scheduled_tokens
    return cpu, wall, tokens / steps


def decode_scenario(n: int, steps: int, async_scheduling: bool, caching: bool):
    max_model_len = 4096
    sched = make_scheduler(n, budget=max(2048, n), max_model_len=max_model_len,
                           num_blocks=n * (128 + steps + 64) // BLOCK_SIZE + 64,
                           async_scheduling=async_scheduling, caching=caching)
    for i in range(n):
        add(sched, f"d{i}", 128, max_model_len)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or sched.waiting:
        so = sched.schedule()
        sched.update_from_output(so, fake_output(sched, so, 0))
    assert len(sched.running) == n
    return run(sched, steps)


def mixed_scenario(n: int, steps: int, async_scheduling: bool, caching: bool):
    """n decodes plus a stream of 8k-token prompts chunked into the budget."""
    max_model_len, budget, prompt_len = 16384, 2048, 8192
    sched = make_scheduler(n + 8, budget=budget, max_model_len=max_model_len,
                           num_blocks=(n * (256 + steps) + 4 * max_model_len) // BLOCK_SIZE + 64,
                           async_scheduling=async_scheduling, caching=caching)
    for i in range(n):
        add(sched, f"d{i}", 128, max_model_len)
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        so = sched.schedule()
        sched.update_from_output(so, fake_output(sched, so, 0))
    counter = iter(range(10**9))

    def keep_a_prefill_waiting(_: int) -> None:
        if not sched.waiting and sum(r.num_prompt_tokens > 128 for r in sched.running) < 2:
            add(sched, f"p{next(counter)}", prompt_len, 1)

    return run(sched, steps, keep_a_prefill_waiting)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave start-up objects to the garbage collector (full-collection pauses)")
    ap.add_argument("--kv-groups", choices=["full", "gemma3"], default="full")
    args = ap.parse_args()
    FREEZE_GC[0] = not args.no_gc_freeze
    GROUPS[0] = GEMMA3 if args.kv_groups == "gemma3" else FULL_ATTENTION
    rows = []
    for name, fn, n in [
        ("decode", decode_scenario, 256),
        ("decode", decode_scenario, 1024),
        ("decode + 8k prefills", mixed_scenario, 256),
    ]:
        for async_scheduling in (False, True):
            for caching in (True, False):
                cpu, wall, tokens = fn(n, args.steps, async_scheduling, caching)
                cpu.sort()
                wall.sort()
                rows.append((name, n, "async" if async_scheduling else "sync",
                             "on" if caching else "off", tokens, statistics.fmean(cpu),
                             cpu[len(cpu) // 2], cpu[int(len(cpu) * 0.99) - 1],
                             wall[len(wall) // 2]))
    print(f"per step: schedule() + update_from_output(), {args.steps} steps, CPU time "
          f"(wall p50 for reference), gc heap {'not ' if args.no_gc_freeze else ''}frozen")
    header = f"{'scenario':<22}{'running':>8}{'sched':>7}{'prefix$':>8}{'tok/step':>9}"
    header += f"{'mean ms':>9}{'p50 ms':>8}{'p99 ms':>8}{'us/req':>8}{'wall p50':>9}"
    print(header)
    print("-" * len(header))
    for name, n, mode, cache, tokens, mean, p50, p99, wall50 in rows:
        print(f"{name:<22}{n:>8}{mode:>7}{cache:>8}{tokens:>9.0f}{mean:>9.3f}{p50:>8.3f}"
              f"{p99:>8.3f}{1000 * mean / n:>8.2f}{wall50:>9.3f}")


if __name__ == "__main__":
    main()
