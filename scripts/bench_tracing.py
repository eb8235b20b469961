"""What request tracing costs: the decode-heavy workload against a server with tracing on and
one with `--no-request-tracing`, alternating (on/off, off/on, ...) so drift hits both alike.

    python scripts/bench_tracing.py [--rounds 3] [--num-prompts 128] [--output-len 256]
    python scripts/bench_tracing.py --micro     # the tracing work of one 64-request step, alone

Prints each run's output throughput and TPOT, then the median ratio on/off. Nothing else may
run on the machine meanwhile: run to run noise is 5-10% on 2 cores, more than tracing costs,
so `--micro` also times what tracing adds per step (engine and API server side, serialization
included) against the same step's outputs without it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = ["--max-model-len", "4096", "--max-num-seqs", "64", "--max-num-batched-tokens", "512",
          "--disable-uvicorn-access-log", "--disable-log-stats"]


def run_once(tracing: bool, port: int, args: argparse.Namespace) -> dict:
    flag = "--request-tracing" if tracing else "--no-request-tracing"
    log = open(os.path.join(tempfile.gettempdir(), f"bench-tracing-{port}.log"), "w")
    server = subprocess.Popen([sys.executable, "-m", "jaxserve.serve", "--port", str(port), flag,
                               *SERVER], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start; see {log.name}")
            time.sleep(1)
        out = os.path.join(tempfile.gettempdir(), f"bench-tracing-{port}.json")
        subprocess.run([sys.executable, "-m", "jaxserve.bench", "serve",
                        "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(args.num_prompts),
                        "--max-concurrency", "64", "--random-input-len", "32",
                        "--random-output-len", str(args.output_len), "--seed", "1",
                        "--output-json", out], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)
    finally:
        server.terminate()
        server.wait(60)


def micro(batch: int = 64, steps: int = 2000) -> None:
    """Median time of one decode step's tracing work for `batch` requests, with and without."""
    from jaxserve.engine_core.core_outputs import EngineCoreOutput
    from jaxserve.engine_core.sched_output import CachedRequestData, SchedulerOutput
    from jaxserve.engine_core.step_trace import StepTrace, StepTracer
    from jaxserve.engine_core.wire import decode_record
    from jaxserve.request_trace import RequestTrace

    ids = [f"cmpl-{i:032x}-0" for i in range(batch)]
    tracer = StepTracer(16)
    traces = {r: RequestTrace(r) for r in ids}

    def step(k: int, traced: bool) -> None:
        so = SchedulerOutput([], CachedRequestData(list(ids), [[] for _ in ids], [100 + k] * batch),
                             {r: 1 for r in ids}, batch, set(), set())
        outs = [EngineCoreOutput(r, [5]) for r in ids]
        if traced:  # what the engine core adds
            st = tracer.scheduled(so, time.time())
            tracer.dispatched(st)
            tracer.done(st, 0.005, 0, 0.0)
            tracer.updated(st, outs)
        table: dict = {}
        payload = [o.to_dict(table) for o in outs]
        steps = {int(k): decode_record(StepTrace, v) for k, v in table.items()}
        for o in (EngineCoreOutput.from_dict(d, steps) for d in payload):
            if traced:  # what the output processor adds
                t = traces[o.req_id]
                t.add_steps(o.trace_steps or [], 0)
                t.record_output(time.time(), 1e-5, len(o.new_token_ids))

    for traced in (True, False):
        times = []
        for k in range(steps):
            t0 = time.perf_counter()
            step(k, traced)
            times.append(time.perf_counter() - t0)
        print(f"{'with' if traced else 'without'} tracing: {1e6 * statistics.median(times):.0f} us "
              f"per {batch}-request step (outputs serialized and read back)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro", action="store_true", help="time the per-step tracing work only")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--port", type=int, default=8150)
    args = p.parse_args()
    if args.micro:
        micro()
        return
    results: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for tracing in order:
            res = run_once(tracing, args.port + len(results[True]) + len(results[False]), args)
            results[tracing].append(res)
            print(f"round {r + 1} tracing {'on ' if tracing else 'off'}: "
                  f"{res['output_throughput']:.1f} out tok/s, TPOT {res['mean_tpot_ms']:.1f} ms",
                  flush=True)
    on = statistics.median(x["output_throughput"] for x in results[True])
    off = statistics.median(x["output_throughput"] for x in results[False])
    print(f"median output throughput: on {on:.1f}, off {off:.1f} tok/s; "
          f"on/off = {on / off:.3f} (overhead {100 * (1 - on / off):+.1f}%)")


if __name__ == "__main__":
    main()
