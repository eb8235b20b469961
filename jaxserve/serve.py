"""`python -m jaxserve.serve`: the OpenAI-compatible server (vLLM's `vllm serve`).

The API server runs in this process and never imports JAX; the engine core
(scheduler + worker) runs in a child process started by
jaxserve.api_server.server. This module only parses vLLM's flags into an
EngineConfig, so it stays JAX-free too.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from jaxserve.config import EngineConfig, SchedulingPolicy, make_engine_config
from jaxserve.model_files import resolve_model


def make_arg_parser() -> argparse.ArgumentParser:
    """vLLM's server and engine flags (the subset jaxserve implements)."""
    p = argparse.ArgumentParser(prog="python -m jaxserve.serve", description=__doc__.splitlines()[0])
    server = p.add_argument_group("server")
    server.add_argument("--model", default=None,
                        help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    server.add_argument("--host", default="127.0.0.1", help="use 0.0.0.0 to listen on every interface")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) the API accepts; the first is reported (default: from --model)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["debug", "info", "warning", "error", "critical"])
    server.add_argument("--disable-uvicorn-access-log", action="store_true")
    server.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
                        help="require `Authorization: Bearer <key>` on every /v1 route "
                             "(default: $JAXSERVE_API_KEY; unset: no authentication)")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept chat templates sent in requests (their cost is unbounded)")
    engine = p.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: the model's)")
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int, default=512)
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV-cache budget in bytes (on the CPU: 2 GiB by default)")
    engine.add_argument("--num-gpu-blocks-override", type=int, default=None)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--scheduling-policy", choices=[p.value for p in SchedulingPolicy],
                        default="fcfs")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="skip compiling the buckets at start-up (compile lazily)")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--attention-backend", default="auto",
                        help="attention kernel variant: auto (the platform's own: cpu, gpu or tpu), "
                             "reference, or any registered variant")
    engine.add_argument("--attention-interpret", action="store_true",
                        help="run Pallas attention variants in interpret mode (tests, research)")
    engine.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    engine.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    engine.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engine-core processes, each with its own devices, KV cache and scheduler")
    return p


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the frozen EngineConfig (raises ValueError naming the bad flag's field)."""
    return make_engine_config(
        args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
        served_model_name=(args.served_model_name or [None])[0],
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy, async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
        attention_interpret=args.attention_interpret,
    )


def main(argv: list[str] | None = None) -> None:
    parser = make_arg_parser()
    args = parser.parse_args(argv)
    try:
        config = engine_config_from_args(args)
        resolve_model(args.model)  # a missing model is a usage error, before any process starts
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    # vLLM's VLLM_LOGGING_LEVEL: DEBUG adds e.g. the traceback behind each 500's error id.
    level = os.environ.get("JAXSERVE_LOGGING_LEVEL", "INFO").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO), format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from jaxserve.api_server.server import run_server

    try:
        sys.exit(asyncio.run(run_server(args, config)))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
