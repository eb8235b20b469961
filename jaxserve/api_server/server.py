"""Run the server: engine-core process, readiness handshake, then uvicorn.

    start the engine core (spawn) ─▶ wait for READY (num_blocks, resolved settings, timings)
    ─▶ start routing outputs and watching the process ─▶ uvicorn accepts connections

If the engine core dies, /health answers 503, in-flight requests fail, and
the server exits with status 1 after a short grace period.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

from jaxserve.api_server.app import build_app
from jaxserve.api_server.server_args import ServerArgs
from jaxserve.api_server.serving import ServingContext
from jaxserve.api_server.symptoms import ServerFacts
from jaxserve.config import EngineConfig
from jaxserve.engine.core_client import AsyncMPClient, EngineStartupError
from jaxserve.engine.core_process import launch_engine_core
from jaxserve.engine.dp_client import DPLBAsyncMPClient
from jaxserve.engine.front_end import load_front_end
from jaxserve.engine.messages import new_ipc_addresses
from jaxserve.engine.protocol import EngineClient
from jaxserve.metrics.prometheus import LoggingStatLogger, ServerMetrics
from jaxserve.metrics.trace_store import TraceStore
from jaxserve.models.model_files import release_gguf_readers

logger = logging.getLogger("jaxserve.api_server")

# After the engine core dies: time for in-flight clients to read their error
# (and for /health to report 503) before the server exits.
ENGINE_DEAD_GRACE_S = 2.0


async def run_server(args: ServerArgs, config: EngineConfig,
                     sock: socket.socket | None = None) -> int:
    """Serve until interrupted (on `sock`, bound at start-up, or host:port); returns the
    process exit status."""
    front = load_front_end(config.model_config, args.generation_config, args.chat_template)
    files, tokenizer, defaults = front.files, front.tokenizer, front.generation_defaults
    release_gguf_readers()  # this process reads the model's files no more
    if defaults:
        logger.info("sampling defaults from generation_config.json: %s "
                    "(--generation-config vllm to ignore them)", defaults)
    # The scheduler stops on the tokenizer's EOS; the model's other EOS ids (config.json,
    # generation_config.json; all of them without a tokenizer) the processor adds as stops.
    eos = front.eos_token_id
    names = list(config.model_config.served_model_name) or [files.name]
    metrics = ServerMetrics(names[0], config.parallel_config.data_parallel_size)
    exporter = None
    if args.otlp_traces_endpoint:
        from jaxserve.api_server.otel import OtlpTraceExporter

        exporter = OtlpTraceExporter(args.otlp_traces_endpoint, names[0])
    traces = TraceStore(enabled=config.request_tracing, exporter=exporter)
    log_level = logging.getLogger().getEffectiveLevel()
    clients: list[AsyncMPClient] = []
    try:
        for rank in range(config.parallel_config.data_parallel_size):
            input_address, output_address = new_ipc_addresses()
            process = launch_engine_core(config, eos, input_address, output_address, log_level, rank)
            clients.append(AsyncMPClient(tokenizer, process, input_address, output_address, metrics,
                                         rank, traces))
            logger.info("engine core process %d (pid %d) is loading %s", rank, process.pid, files.path)
        client: EngineClient = clients[0] if len(clients) == 1 else DPLBAsyncMPClient(clients)
        try:
            ready = await client.wait_until_ready()
        except EngineStartupError as e:
            logger.error("engine core failed to start: %s", e)
            return 1
        t = ready.timings
        logger.info(
            "engine core ready in %.1f s: %s, %d KV pages of %d tokens, max_model_len %d, "
            "max_num_seqs %d (load %.1f s, compile %s)",
            t.get("total_s", 0.0), files.name, ready.num_blocks, ready.block_size,
            ready.max_model_len, ready.max_num_seqs, t.get("load_s", 0.0),
            f"{t['compile_s']:.1f} s" if "compile_s" in t else "lazy (--enforce-eager)",
        )
        metrics.record_cache_config(ready.block_size, ready.num_blocks,
                                    str(ready.resolved.kv_cache_dtype.value),
                                    config.cache_config.enable_prefix_caching,
                                    config.parallel_config.data_parallel_size)
        ctx = ServingContext(client=client, tokenizer=tokenizer, served_model_names=names,
                             processor=front.processor(ready.max_model_len, ready.vocab_size,
                                                       config.pooler_config, args.max_logprobs,
                                                       ready.resolved.classifier),
                             trust_request_chat_template=args.trust_request_chat_template,
                             default_sampling=defaults,
                             tool_call_parser=args.tool_call_parser,
                             enable_auto_tool_choice=args.enable_auto_tool_choice,
                             reasoning_parser=args.reasoning_parser, traces=traces, metrics=metrics,
                             enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                             responses_store_size=args.responses_store_size,
                             facts=ServerFacts(ready.max_num_seqs,
                                               config.scheduler_config.max_num_batched_tokens,
                                               config.enforce_eager,
                                               config.parallel_config.data_parallel_size))
        app = build_app(ctx, metrics, on_shutdown=client.shutdown, api_key=args.api_key,
                        cors=dict(allow_origins=list(args.allowed_origins),
                                  allow_methods=list(args.allowed_methods),
                                  allow_headers=list(args.allowed_headers),
                                  allow_credentials=args.allow_credentials))
        server = _Server(lambda: client.fail_in_flight("the server is shutting down"), uvicorn.Config(
            app, host=args.host, port=args.port,
            log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
            root_path=args.root_path or "",
            timeout_graceful_shutdown=5,
        ))
        loop = asyncio.get_running_loop()
        exit_code = 0

        def on_engine_dead(reason: str) -> None:
            nonlocal exit_code
            exit_code = 1
            loop.call_later(ENGINE_DEAD_GRACE_S, setattr, server, "should_exit", True)

        client.on_dead = on_engine_dead
        client.start()
        tasks = [loop.create_task(_announce_when_started(server, args.host, names[0]))]
        if not args.disable_log_stats:
            tasks.append(loop.create_task(_log_stats(LoggingStatLogger(metrics))))
        try:
            await server.serve(sockets=[sock] if sock is not None else None)
        finally:
            for task in tasks:
                task.cancel()
        if exit_code:
            logger.error("exiting: %s", client.dead_error)
        return exit_code
    finally:
        # Every way out (a failed start-up, an exception here, a signal): the engine
        # processes stop and their IPC files go (shutdown is idempotent; what this misses,
        # messages' atexit removes).
        await asyncio.gather(*(c.shutdown() for c in clients), return_exceptions=True)
        if exporter is not None:
            await asyncio.to_thread(exporter.shutdown)  # send what is still batched


class _Server(uvicorn.Server):
    """uvicorn's server, ending in-flight requests cleanly (an error, then [DONE]) when a
    signal stops it, instead of letting the graceful-shutdown timeout cancel them."""

    def __init__(self, on_exit: Callable[[], None], config: uvicorn.Config) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            # A signal handler interrupts the loop anywhere: touch its queues from the loop.
            asyncio.get_running_loop().call_soon_threadsafe(self._on_exit)
        super().handle_exit(sig, frame)


# vLLM's VLLM_LOG_STATS_INTERVAL.
LOG_STATS_INTERVAL_S = float(os.environ.get("JAXSERVE_LOG_STATS_INTERVAL", "10"))


async def _log_stats(stat_logger: LoggingStatLogger) -> None:
    """vLLM's "Avg prompt throughput ..." line every 10 s while there is work."""
    while True:
        await asyncio.sleep(LOG_STATS_INTERVAL_S)
        line = stat_logger.line()
        if line:
            logger.info("%s", line)


async def _announce_when_started(server: uvicorn.Server, host: str, model: str) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    for s in server.servers:
        for sock in s.sockets:
            port = sock.getsockname()[1]
            shown = "localhost" if host in ("0.0.0.0", "::") else host
            logger.info("serving %s at http://%s:%d/v1 (OpenAI and Anthropic APIs; /health, "
                        "/metrics)", model, shown, port)
            return
