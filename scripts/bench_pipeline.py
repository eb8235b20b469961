"""Pipeline parallelism on fake CPU devices: microbatches (stages overlap) against one
step at a time (`async_scheduling=False`), same requests, greedy.

    python scripts/bench_pipeline.py [--pp 2] [--num-prompts 16] [--max-tokens 64]

Prints output tokens/s of each, whether the tokens are identical, and the steps whose
stages overlapped (StageTimeline). On a 2-core CPU the stages share the cores, so the
gain is bounded; on accelerators each stage has devices of its own.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    a = p.parse_args()

    from jaxserve import LLM, SamplingParams
    from jaxserve.parallel.stage_timeline import StageTimeline

    prompts = [f"Story {i}: once upon a time, in a land far away," for i in range(a.num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    results = {}
    for name, async_scheduling in (("one step at a time", False), ("microbatches", True)):
        llm = LLM(max_model_len=512, max_num_seqs=a.max_num_seqs, pipeline_parallel_size=a.pp,
                  async_scheduling=async_scheduling, kv_cache_memory_bytes=256 << 20)
        llm.generate(prompts[:2], sp, use_tqdm=False)
        timeline = StageTimeline.attach(llm.engine.worker.runner)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        timeline.stop()
        steps = len({n for n, _ in timeline.done})
        results[name] = [o.outputs[0].token_ids for o in outs]
        tokens = sum(map(len, results[name]))
        print(f"pp={a.pp} {name:>18}: {tokens / dt:6.1f} out tok/s ({tokens} tokens, {dt:.1f} s, "
              f"{steps} steps, {len(timeline.overlapped_steps())} overlapped with the next)",
              flush=True)
        llm.shutdown()
        del llm
    print("identical tokens:", results["one step at a time"] == results["microbatches"])


if __name__ == "__main__":
    main()
