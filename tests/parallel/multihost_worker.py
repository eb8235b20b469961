"""One process of a two-process (multi-host) engine on this machine, TP = 2 across processes.

    python -m tests.parallel.multihost_worker PROCESS_ID PORT
    python -m tests.parallel.multihost_worker single      (the same engine in one process)
Process 0 generates (greedy, then sampled at temperature 1 without per-request seeds) and
prints RESULTS and SAMPLED json; process 1 follows its steps. The sampled tokens match the
single-process run only if every process derives the same seed for each request.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The same prompts as mesh_worker (not imported: it asks for 8 devices per process).
PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time, in a land far away, there lived a dragon who",
]

ENGINE_ARGS = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                   kv_cache_memory_bytes=64 << 20, tensor_parallel_size=2)


def generate(llm: object) -> None:
    from jaxserve import SamplingParams

    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)
    llm.shutdown()
    print("RESULTS " + json.dumps([o.outputs[0].token_ids for o in greedy]))
    print("SAMPLED " + json.dumps([o.outputs[0].token_ids for o in sampled]))


def main() -> None:
    from jaxserve import LLM

    if sys.argv[1] == "single":
        generate(LLM(None, **{**ENGINE_ARGS, "tensor_parallel_size": 1}))
        return
    pid, port = int(sys.argv[1]), int(sys.argv[2])
    dist = dict(distributed_coordinator_address=f"127.0.0.1:{port}", distributed_num_processes=2,
                distributed_process_id=pid)
    if pid != 0:
        from jaxserve.engine import run_follower_process
        from jaxserve.config import make_engine_config

        steps = run_follower_process(make_engine_config(None, **ENGINE_ARGS, **dist))
        print(f"FOLLOWED {steps} steps")
        return
    generate(LLM(None, **ENGINE_ARGS, **dist))


if __name__ == "__main__":
    main()
