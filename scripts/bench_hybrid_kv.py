"""Concurrent long requests in one KV budget, with and without the hybrid KV cache manager.

A Gemma-3-shaped model (five sliding-window layers to one full-attention layer, random weights
from its config.json alone) serves long prompts offline in a fixed --kv-cache-memory-bytes.
With sliding-window groups each request holds its window's pages in five of every six layers,
so more requests run at once; `--disable-hybrid-kv-cache-manager` keeps every page of every
layer (one group), the cache as it was before the groups. The two modes alternate in one run.

Reported per mode: pages of the cache, the most requests running at once, the run's wall time,
and a decode phase (as many 200-token prompts, 128 tokens out: they fit either way) in output
tokens per second.

    python scripts/bench_hybrid_kv.py [--prompt-tokens 6000] [--requests 32] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

WINDOW = 512


def write_config(path: str, layers: int) -> str:
    """A small Gemma-3-shaped config.json: every sixth layer full attention."""
    cfg = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": 32768, "hidden_size": 256, "intermediate_size": 1024,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 64, "sliding_window": WINDOW, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
        "query_pre_attn_scalar": 64, "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                        for i in range(layers)],
        "bos_token_id": 2, "eos_token_id": 1, "torch_dtype": "bfloat16",
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def run_mode(model: str, hybrid: bool, args: argparse.Namespace) -> dict[str, float]:
    from jaxserve import LLM, SamplingParams

    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True,
              max_model_len=args.max_model_len, max_num_seqs=args.requests,
              kv_cache_memory_bytes=args.kv_bytes, disable_hybrid_kv_cache_manager=not hybrid)
    sched = llm.engine_core.scheduler
    peak = [0]
    schedule = sched.schedule

    def counting_schedule():  # the most requests holding pages at once
        out = schedule()
        peak[0] = max(peak[0], len(sched.running))
        return out

    sched.schedule = counting_schedule
    rng = random.Random(0)
    long = [{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(args.prompt_tokens)]}
            for _ in range(args.requests)]
    # Long enough outputs that finished prompts keep decoding while later ones prefill: the
    # most running at once is then what the cache holds.
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(long, params, use_tqdm=False)
    long_s = time.perf_counter() - t0
    sched.schedule = schedule
    short = [{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(200)]}
             for _ in range(args.requests)]
    decode = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate(short[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
    t0 = time.perf_counter()
    outs = llm.generate(short, decode, use_tqdm=False)
    decode_s = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"pages": sched.kv_cache_manager.block_pool.num_blocks - 1,
              "peak_running": peak[0], "long_s": round(long_s, 1),
              "decode_tok_s": round(tokens / decode_s, 1)}
    llm.shutdown()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=6000)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--kv-bytes", type=int, default=100 << 20)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    model = write_config(tempfile.mkdtemp(prefix="gemma3-shaped-"), args.layers)
    for r in range(args.rounds):
        for hybrid in (False, True):  # alternating, in one run
            res = run_mode(model, hybrid, args)
            print(json.dumps({"round": r, "hybrid": hybrid, **res}), flush=True)


if __name__ == "__main__":
    main()
