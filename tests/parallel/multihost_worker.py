"""One process of a two-process (multi-host) engine on this machine, TP = 2 across processes.

    python -m tests.parallel.multihost_worker PROCESS_ID PORT
    python -m tests.parallel.multihost_worker single      (the same engine in one process)
Both processes run the same script: process 0 generates (greedy, then sampled at temperature 1
without per-request seeds) and prints RESULTS and SAMPLED json; in process 1, `LLM(...)` follows
process 0's steps and then exits, so the rest of the script is process 0's. The sampled tokens match the
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

# enforce_eager: the programs the steps use, compiled on first use, by both processes alike.
ENGINE_ARGS = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                   kv_cache_memory_bytes=64 << 20, tensor_parallel_size=2, enforce_eager=True)


def generate(llm: object) -> None:
    from jaxserve import SamplingParams

    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)
    llm.shutdown()
    print("RESULTS " + json.dumps([o.outputs[0].token_ids for o in greedy]))
    print("TEXTS " + json.dumps([o.outputs[0].text for o in greedy]))
    print("SAMPLED " + json.dumps([o.outputs[0].token_ids for o in sampled]))


def main() -> None:
    from jaxserve import LLM

    if sys.argv[1] == "single":
        generate(LLM(None, **{**ENGINE_ARGS, "tensor_parallel_size": 1}))
        return
    pid, port = int(sys.argv[1]), int(sys.argv[2])
    # The JAX_* variables, as a user sets them on each host.
    os.environ.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                      JAX_PROCESS_ID=str(pid))
    generate(LLM(None, **ENGINE_ARGS))
    print("END OF SCRIPT")


if __name__ == "__main__":
    main()
