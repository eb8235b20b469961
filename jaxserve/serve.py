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
import signal
import socket
import sys
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.api_server.reasoning_parsers import REASONING_PARSERS
from jaxserve.api_server.tool_parsers import TOOL_PARSERS
from jaxserve.models.model_files import resolve_model
from jaxserve.sampling_params import MAX_LOGPROBS


def make_arg_parser() -> argparse.ArgumentParser:
    """vLLM's server and engine flags (the subset jaxserve implements)."""
    p = engine_arg_parser("python -m jaxserve.serve", __doc__.splitlines()[0])
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="use 0.0.0.0 to listen on every interface")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
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
    server.add_argument("--chat-template", default=None,
                        help="a Jinja chat template (a file, or the template itself) replacing "
                             "the tokenizer's")
    server.add_argument("--generation-config", default="auto",
                        help="sampling defaults: auto (the model's generation_config.json), vllm "
                             "(none: vLLM's own defaults) or a folder holding one")
    server.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                        help=f"most logprobs / prompt_logprobs a request may ask for (at most "
                             f"{MAX_LOGPROBS})")
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
    server.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="export each request's trace as OpenTelemetry spans to this OTLP "
                             "HTTP endpoint (e.g. http://127.0.0.1:4318/v1/traces; needs the otel extra)")
    EngineArgs.add_cli_args(p)
    return p


def engine_arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A command line of the engine (serve, preflight): the model as a positional argument
    (`vllm serve MODEL`'s form); the caller adds its own flags, then the engine's."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (same as --model)")
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
    return EngineArgs.from_cli_args(args).create_engine_config()


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
        dist = config.parallel_config.distributed()
        num_processes, process_id = dist.num_processes, dist.process_id
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    if num_processes > 1 and config.parallel_config.data_parallel_size > 1:
        parser.error("--data-parallel-size with multi-host (JAX_NUM_PROCESSES > 1) is not supported")
    if args.skip_tokenizer_init:
        given = [flag for flag, value in (("--tokenizer", args.tokenizer),
                                          ("--chat-template", args.chat_template),
                                          ("--tool-call-parser", args.tool_call_parser),
                                          ("--reasoning-parser", args.reasoning_parser))
                 if value is not None]
        if given:
            parser.error(f"--skip-tokenizer-init serves token ids only: {', '.join(given)} "
                         "needs a tokenizer")
    if process_id != 0:
        sys.exit(follow(config, process_id, num_processes))
    if args.chat_template is not None:
        try:
            args.chat_template = read_chat_template(args.chat_template)
        except (argparse.ArgumentTypeError, OSError) as e:
            parser.error(str(e))
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        parser.error(f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the sampler computes "
                     f"{MAX_LOGPROBS}), got {args.max_logprobs}")
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

    # SIGTERM (systemd, docker stop, kill) ends the server as Ctrl-C does: through run_server's
    # cleanup, also while the engine is still loading (uvicorn handles both signals while it
    # serves, then raises the one it got again, which lands here).
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        sys.exit(asyncio.run(run_server(args, config)))
    except KeyboardInterrupt:
        sys.exit(0)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == "__main__":
    main()
