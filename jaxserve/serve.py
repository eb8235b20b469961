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

from jaxserve.api_server.server_args import ServerArgs
from jaxserve.config import EngineConfig
from jaxserve.engine.arg_utils import EngineArgs, engine_arg_parser, engine_config_from_args
from jaxserve.models.model_files import ModelFormat, read_hf_config, resolve_model


def make_arg_parser() -> argparse.ArgumentParser:
    """vLLM's server and engine flags (the subset jaxserve implements)."""
    p = engine_arg_parser("python -m jaxserve.serve", __doc__.splitlines()[0])
    ServerArgs.add_cli_args(p)
    EngineArgs.add_cli_args(p)
    return p


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
    try:
        config = engine_config_from_args(args)
        # A missing model is a usage error, before any process starts; so is a checkpoint
        # stored quantized in a format jaxserve does not read (refused by name).
        mc = config.model_config
        files = resolve_model(mc.model, mc.hf_overrides)
        if files.format == ModelFormat.HF:
            read_hf_config(files.path, files.hf_overrides)
        dist = config.parallel_config.distributed()
        num_processes, process_id = dist.num_processes, dist.process_id
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    if num_processes > 1 and config.parallel_config.data_parallel_size > 1:
        parser.error("--data-parallel-size with multi-host (JAX_NUM_PROCESSES > 1) is not supported")
    if process_id != 0:
        sys.exit(follow(config, process_id, num_processes))
    if args.tokenizer is not None:
        try:
            resolve_model(args.tokenizer)
        except (ValueError, FileNotFoundError) as e:
            parser.error(f"--tokenizer: {e}")
    try:
        server_args = ServerArgs.from_cli_args(args, config)
    except ValueError as e:
        parser.error(str(e))
    try:
        sock = bind_socket(server_args.host, server_args.port)
    except OSError as e:
        parser.error(f"cannot listen on {server_args.host}:{server_args.port}: {e.strerror or e}"
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
        sys.exit(asyncio.run(run_server(server_args, config, sock)))
    except KeyboardInterrupt:
        sys.exit(0)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == "__main__":
    main()
