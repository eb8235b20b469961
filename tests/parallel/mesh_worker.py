"""Run LLM configurations on 8 fake CPU devices and print their greedy tokens as JSON.

Used by test_parallel.py in a subprocess: XLA_FLAGS must be set before JAX starts. Each engine
compiles only the programs its steps use (enforce_eager: no warm-up of every bucket; what each
layout compiles for real devices is tests/device_compile's).
    python -m tests.parallel.mesh_worker MODEL '[[tp, pp], [tp, pp, "int8"], ...]'
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time, in a land far away, there lived a dragon who",
]


def main() -> None:
    import time

    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.parallel.stage_timeline import StageTimeline

    model = None if sys.argv[1] == "default" else sys.argv[1]
    results = {}
    for tp, pp, *quant in json.loads(sys.argv[2]):
        quantization = quant[0] if quant else None
        key = f"{tp}x{pp}" + (f"-{quantization}" if quantization else "")
        t0 = time.perf_counter()
        llm = LLM(model, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                  kv_cache_memory_bytes=64 << 20, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                  quantization=quantization, enforce_eager=True)
        startup = time.perf_counter() - t0
        timeline = StageTimeline.attach(llm.engine.worker.runner) if pp > 1 else None
        t0 = time.perf_counter()
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        gen = time.perf_counter() - t0
        worker = llm.engine.worker
        shardings = {}
        for st in worker.stages:
            for path, leaf in jax.tree_util.tree_flatten_with_path(st.params)[0]:
                name = "/".join(str(p.key) for p in path[1:])
                shardings[f"stage{st.index}/{name}"] = [str(leaf.sharding.spec), len(leaf.sharding.device_set)]
        results[key] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "startup_s": startup, "generate_s": gen,
            "shardings": shardings,
        }
        if timeline is not None:
            timeline.stop()
            results[key]["overlapped_steps"] = timeline.overlapped_steps()
            results[key]["dispatched_ahead"] = timeline.dispatched_ahead()
            results[key]["timeline"] = timeline.format()
        del llm
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
