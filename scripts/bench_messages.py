"""What the engine-core <-> API-server messages cost on the host: one step's OUTPUTS message
for N running requests (outputs with trace entries, the step table, scheduler stats) and one
ADD message of N requests, each encoded and decoded the way the two processes do (msgpack
included), median over many rounds.

    python scripts/bench_messages.py [--batch 64] [--rounds 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.engine.messages import EngineCoreRequest, decode, encode  # noqa: E402
from jaxserve.engine_core.core_outputs import EngineCoreOutput  # noqa: E402
from jaxserve.engine_core.sched_output import CachedRequestData, SchedulerOutput  # noqa: E402
from jaxserve.engine_core.stats import SchedulerStats  # noqa: E402
from jaxserve.engine_core.step_trace import StepTrace, StepTracer  # noqa: E402
from jaxserve.engine_core.wire import decode_record, encode_record  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402


def outputs_round(ids: list[str], tracer: StepTracer, k: int) -> None:
    batch = len(ids)
    so = SchedulerOutput([], CachedRequestData(list(ids), [[] for _ in ids], [100 + k] * batch),
                         {r: 1 for r in ids}, batch, set(), set())
    outs = [EngineCoreOutput(r, [5]) for r in ids]
    st = tracer.scheduled(so, time.time())
    tracer.dispatched(st)
    tracer.done(st, 0.005, 0, 0.0)
    tracer.updated(st, outs)
    steps: dict = {}
    payload = {"outputs": [encode_record(o, steps) for o in outs], "steps": steps,
               "stats": encode_record(SchedulerStats(batch, 0, 0.5, step_stats=tracer.stats()))}
    _, back = decode(encode(1, payload))
    table = {int(s): decode_record(StepTrace, v) for s, v in back["steps"].items()}
    [decode_record(EngineCoreOutput, d, table) for d in back["outputs"]]
    decode_record(SchedulerStats, back["stats"])


def add_round(ids: list[str], params: SamplingParams) -> None:
    frame = encode(0, [encode_record(EngineCoreRequest(r, list(range(500)), params, 1.0))
                       for r in ids])
    [EngineCoreRequest.decode(v) for v in decode(frame)[1]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2000)
    args = p.parse_args()
    ids = [f"cmpl-{i:032x}-0" for i in range(args.batch)]
    tracer, params = StepTracer(16), SamplingParams(temperature=0.7, max_tokens=256, stop=["\n"])
    for name, fn in (("OUTPUTS", lambda k: outputs_round(ids, tracer, k)),
                     ("ADD", lambda k: add_round(ids, params))):
        times = []
        for k in range(args.rounds):
            t0 = time.perf_counter()
            fn(k)
            times.append(time.perf_counter() - t0)
        print(f"{name}: {1e6 * statistics.median(times):.0f} us per {args.batch}-request message "
              "(encoded and decoded, msgpack included)")


if __name__ == "__main__":
    main()
