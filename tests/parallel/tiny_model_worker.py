"""Greedy tokens of a tiny checkpoint under tensor (and, for a mixture of experts, expert)
parallelism on fake CPU devices, and each device's share of the expert weights, as JSON.

Used by tests/models/test_moe.py and test_gemma.py in a subprocess (XLA_FLAGS must be set
before JAX starts):
    python -m tests.parallel.tiny_model_worker MODEL_DIR '[[tp, ep(, "int8" | null(, pp))], ...]' PROMPTS

"stored" for the quantization serves a checkpoint stored quantized at its own width
(`--no-cpu-auto-bf16`: int values, not dequantized into bf16).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    import jax

    from jaxserve import LLM, SamplingParams

    model, configs, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = {}
    for tp, ep, *rest in configs:
        quant, pp = (rest + [None, 1][len(rest):])[:2]
        llm = LLM(model, skip_tokenizer_init=True, tensor_parallel_size=tp,
                  pipeline_parallel_size=pp, quantization=None if quant == "stored" else quant,
                  cpu_auto_bf16=quant != "stored",
                  enable_expert_parallel=ep, max_model_len=128, max_num_seqs=4,
                  max_num_batched_tokens=16, block_size=4, kv_cache_memory_bytes=4 << 20,
                  enforce_eager=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        layers = llm.engine.worker.stages[0].params["params"]["layers"]
        mlp = layers["mlp"]
        key = f"tp{tp}-ep{int(ep)}" + (f"-{quant}" if quant else "") + (f"-pp{pp}" if pp > 1 else "")
        r = results[key] = {"tokens": [o.outputs[0].token_ids for o in outs],
                            "weight_format": llm.engine.worker.weight_format.value}
        if "scale" in layers["self_attn"]["q_proj"]:  # scaled weights: where the scales live
            r["q_proj_scale_spec"] = str(layers["self_attn"]["q_proj"]["scale"].sharding.spec)
        if "w_gate" in mlp:  # a mixture of experts
            experts = jax.tree.leaves([mlp[n] for n in ("w_gate", "w_up", "w_down")])
            r["expert_bytes_per_device"] = sum(a.addressable_shards[0].data.nbytes for a in experts)
            r["expert_bytes"] = sum(a.nbytes for a in experts)
            gate = mlp["w_gate"]["qweight"] if isinstance(mlp["w_gate"], dict) else mlp["w_gate"]
            r["w_gate_spec"] = str(gate.sharding.spec)
            r["experts_dtype"] = str(gate.dtype)
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
