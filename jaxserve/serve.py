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
import re
import socket
import sys

from jaxserve.config import KV_CACHE_DTYPES, EngineConfig, SchedulingPolicy, make_engine_config
from jaxserve.api_server.reasoning_parsers import REASONING_PARSERS
from jaxserve.api_server.tool_parsers import TOOL_PARSERS
from jaxserve.models.model_files import resolve_model


_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def human_readable_int(value: str) -> int:
    """`8k`/`2G` -> an int, vLLM's rule: lowercase k/m/g/t are powers of 1000, uppercase (and
    KiB/MiB/GiB/TiB) powers of 1024; kB/MB/GB decimal. Plain integers pass through."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?)([bB]?)\s*", value)
    if not m:
        raise argparse.ArgumentTypeError(f"not a number or size: {value!r} (e.g. 4096, 8k, 2GiB)")
    number, unit, binary, _ = m.groups()
    base = 1024 if binary or (unit.isupper() and not m.group(4)) else 1000
    result = float(number) * base ** _UNITS[unit.lower()]
    if result != int(result):
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number")
    return int(result)


def make_arg_parser() -> argparse.ArgumentParser:
    """vLLM's server and engine flags (the subset jaxserve implements)."""
    p = argparse.ArgumentParser(prog="python -m jaxserve.serve", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (same as --model)")
    server = p.add_argument_group("server")
    server.add_argument("--model", default=None,
                        help="HF directory or .gguf file; None: SmolLM2-135M-Instruct, bundled")
    server.add_argument("--host", default="127.0.0.1", help="use 0.0.0.0 to listen on every interface")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) the API accepts; the first is reported (default: from --model)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["debug", "info", "warning", "error", "critical"],
                        help="uvicorn's own log level")
    server.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no log line per HTTP request")
    server.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic throughput / KV-usage log line")
    # NOTE: the environment is read after parsing: --help must not print the key.
    server.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer <key>` on every /v1 route "
                             "(or set $JAXSERVE_API_KEY; neither: no authentication)")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept chat templates sent in requests (their cost is unbounded)")
    server.add_argument("--tokenizer", default=None,
                        help="HF directory or .gguf file of the tokenizer, if not the model's")
    server.add_argument("--chat-template", default=None,
                        help="a Jinja chat template (a file, or the template itself) replacing "
                             "the tokenizer's")
    server.add_argument("--generation-config", default="auto",
                        help="sampling defaults: auto (the model's generation_config.json), vllm "
                             "(none: vLLM's own defaults) or a folder holding one")
    server.add_argument("--max-logprobs", type=int, default=20,
                        help="most logprobs / prompt_logprobs a request may ask for (at most 20)")
    server.add_argument("--root-path", default=None,
                        help="the path prefix a reverse proxy serves this API under")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model call tools on its own (tool_choice "auto"); needs --tool-call-parser')
    server.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="how the model writes tool calls (hermes/qwen: <tool_call> tags; "
                             "llama3_json; mistral: [TOOL_CALLS])")
    server.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="split <think>...</think> into the message's reasoning field")
    server.add_argument("--allowed-origins", type=json_list, default=["*"],
                        help="CORS: origins allowed to call the API (a JSON list)")
    server.add_argument("--allowed-methods", type=json_list, default=["*"], help="CORS methods")
    server.add_argument("--allowed-headers", type=json_list, default=["*"], help="CORS headers")
    server.add_argument("--allow-credentials", action="store_true", help="CORS credentials")
    engine = p.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=human_readable_int, default=None,
                        help="context length (default: the model's)")
    engine.add_argument("--max-num-seqs", type=int, default=64,
                        help="most requests in the running batch")
    engine.add_argument("--max-num-batched-tokens", type=human_readable_int, default=512,
                        help="most tokens in one step (chunked prefill splits longer prompts)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache page")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of accelerator memory for weights, activations and KV cache")
    engine.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None,
                        help="KV-cache budget in bytes, e.g. 2GiB (None: on the CPU 2 GiB, elsewhere "
                             "--gpu-memory-utilization of the device)")
    engine.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="KV cache values: auto (the model's dtype) or fp8 (= fp8_e4m3) / "
                             "fp8_e5m2, one byte each (k_scale = v_scale = 1.0)")
    engine.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="KV-cache pages, overriding the memory budget")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse KV pages of shared prompt prefixes")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="schedule step N+1 while step N runs")
    engine.add_argument("--scheduling-policy", choices=[p.value for p in SchedulingPolicy],
                        default="fcfs", help="order of the waiting queue")
    engine.add_argument("--request-tracing", action=argparse.BooleanOptionalAction, default=True,
                        help="trace each request box by box (/debug); --no-request-tracing turns it off")
    engine.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="export each request's trace as OpenTelemetry spans to this OTLP "
                             "HTTP endpoint (e.g. http://127.0.0.1:4318/v1/traces; needs the otel extra)")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="skip compiling the buckets at start-up (compile lazily)")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations (auto: float32 on the CPU, bfloat16 elsewhere)")
    engine.add_argument("--quantization", "-q", default=None, choices=["int8"],
                        help="int8: per-channel int8 weights quantized at load from any checkpoint, "
                             "dequantized inside the matmul")
    engine.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights of the model's shapes (its config.json "
                             "alone suffices), for benchmarks and device checks")
    engine.add_argument("--seed", type=int, default=0,
                        help="engine seed (requests without a seed derive theirs from it)")
    engine.add_argument("--attention-backend", default="auto",
                        help="attention kernel variant: auto (the platform's own: cpu, gpu or tpu), "
                             "reference, or any registered variant")
    engine.add_argument("--attention-interpret", action="store_true",
                        help="run Pallas attention variants in interpret mode (tests, research)")
    engine.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", '
                             '"num_speculative_tokens": 4}\' (keys: prompt_lookup_max, '
                             'prompt_lookup_min, disable_by_batch_size); turns off async scheduling')
    engine.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="devices each layer is split over")
    engine.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="stages the layers are split into")
    engine.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engine-core processes, each with its own devices, KV cache and scheduler")
    return p


def json_list(value: str) -> list[str]:
    """A JSON list of strings (vLLM's --allowed-origins form)."""
    import json

    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return parsed


def json_object(value: str) -> dict:
    """A JSON object (vLLM's --speculative-config form)."""
    import json

    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def read_chat_template(value: str) -> str:
    """--chat-template: a file's contents, or the argument itself (vLLM's rule)."""
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" not in value:
        raise argparse.ArgumentTypeError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the engine starts loading (so a port in
    use is reported at once, not after loading and compiling). Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the frozen EngineConfig (raises ValueError naming the bad flag's field)."""
    return make_engine_config(
        args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
        served_model_name=(args.served_model_name or [None])[0], tokenizer=args.tokenizer,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override, kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy, async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enforce_eager=args.enforce_eager, attention_backend=args.attention_backend,
        attention_interpret=args.attention_interpret, request_tracing=args.request_tracing,
        speculative_config=args.speculative_config, quantization=args.quantization,
        load_format=args.load_format,
    )


def follow(config: EngineConfig, process_id: int, num_processes: int) -> int:
    """Process k > 0 of a multi-host server (the same command on every host): no API server
    here; build the same worker and run every step process 0 broadcasts, until it stops."""
    level = os.environ.get("JAXSERVE_LOGGING_LEVEL", "INFO").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO),
                        format=f"%(levelname)s %(asctime)s [process {process_id}] %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("jaxserve").info("process %d of %d: following process 0 (which serves the API)",
                                       process_id, num_processes)
    from jaxserve.engine.build import run_follower_process  # imports JAX: this process is a worker

    run_follower_process(config)
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = make_arg_parser()
    args = parser.parse_args(argv)
    args.api_key = args.api_key or os.environ.get("JAXSERVE_API_KEY") or None
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    try:
        config = engine_config_from_args(args)
        resolve_model(args.model)  # a missing model is a usage error, before any process starts
        _, num_processes, process_id = config.parallel_config.distributed()
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    if num_processes > 1 and config.parallel_config.data_parallel_size > 1:
        parser.error("--data-parallel-size with multi-host (JAX_NUM_PROCESSES > 1) is not supported")
    if process_id != 0:
        sys.exit(follow(config, process_id, num_processes))
    if args.chat_template is not None:
        try:
            args.chat_template = read_chat_template(args.chat_template)
        except (argparse.ArgumentTypeError, OSError) as e:
            parser.error(str(e))
    if not 0 <= args.max_logprobs <= 20:
        parser.error(f"--max-logprobs must be in [0, 20] (the sampler computes 20), "
                     f"got {args.max_logprobs}")
    if args.tokenizer is not None:
        try:
            resolve_model(args.tokenizer)
        except (ValueError, FileNotFoundError) as e:
            parser.error(f"--tokenizer: {e}")
    if args.otlp_traces_endpoint and not args.request_tracing:
        parser.error("--otlp-traces-endpoint needs request tracing (drop --no-request-tracing)")
    if args.otlp_traces_endpoint:
        try:
            import opentelemetry.sdk  # noqa: F401
        except ImportError:
            parser.error("--otlp-traces-endpoint needs OpenTelemetry: pip install -e '.[otel]'")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if args.generation_config not in ("auto", "vllm") and not os.path.isdir(args.generation_config):
        parser.error(f"--generation-config: {args.generation_config!r} is neither auto, vllm "
                     "nor a folder")
    try:
        args.socket = bind_socket(args.host, args.port)
    except OSError as e:
        parser.error(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}"
                     + (" (is another server running there?)" if e.errno == 98 else ""))
    # vLLM's VLLM_LOGGING_LEVEL: DEBUG adds e.g. the traceback behind each 500's error id.
    level = os.environ.get("JAXSERVE_LOGGING_LEVEL", "INFO").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO), format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    # The API server uses transformers for tokenizers only: its "PyTorch was not found"
    # advice is noise here.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from jaxserve.api_server.server import run_server

    try:
        sys.exit(asyncio.run(run_server(args, config)))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
