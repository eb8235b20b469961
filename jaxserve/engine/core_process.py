"""The engine-core process: the busy loop between ZeroMQ and `EngineCore`.

    while True:
        drain the input socket (block only when there is no work)
        outputs = core.step_with_batch_queue()     # schedule, execute, update
        send outputs + scheduler stats

`python -m jaxserve.serve` starts it with multiprocessing (spawn) through
`launch_engine_core`. This module's top level stays JAX-free so that the API
server can import it to start the process; JAX is imported in the child by
`run_engine_core` (through jaxserve.engine.build).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import traceback
from typing import Any

import zmq

from jaxserve.config import EngineConfig, ParallelConfig
from jaxserve.engine.messages import (
    EngineCoreMessageType,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineReady,
    RequestError,
    decode,
    encode,
)
from jaxserve.engine_core.core import EngineCore, freeze_gc_heap
from jaxserve.engine_core.core_outputs import EngineCoreOutput
from jaxserve.engine_core.request import InvalidRequestError, Request
from jaxserve.engine_core.wire import encode_record

logger = logging.getLogger("jaxserve.engine_core")

# While idle, wake up this often to check that the API server is still alive.
PARENT_CHECK_INTERVAL_MS = 1000


class EngineCoreProc:
    """Runs one EngineCore behind a PULL (input) and a PUSH (output) socket."""

    def __init__(self, core: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket,
                 parent_pid: int) -> None:
        self.core = core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        # Scheduler stats changed since they were last sent (requests came or went).
        self.stats_dirty = False

    def run_busy_loop(self) -> None:
        """Serve until told to shut down or the parent goes away."""
        core = self.core
        while True:
            if not self.process_input_queue():
                return
            if not core.has_work():
                continue
            outputs = core.step_fn()
            if outputs is None:  # only dispatched; the next turn collects
                continue
            if outputs:
                self.send_outputs(outputs)
            else:
                self.stats_dirty = True

    def process_input_queue(self) -> bool:
        """Handle every pending message; block while there is no work.
        False when told to shut down or when the API server has gone away."""
        if not self.core.has_work():
            if self.stats_dirty:
                self.send_outputs([])  # the gauges must read idle (running 0, pages freed)
            while not self.poller.poll(PARENT_CHECK_INTERVAL_MS):
                if not self._parent_alive():
                    return False
        elif not self._parent_alive():  # a getppid() per step: cheap
            return False
        while True:
            try:
                frame = self.input_socket.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return True
            kind, payload = decode(frame)
            if kind == EngineCoreRequestType.SHUTDOWN:
                return False
            self.handle_message(kind, payload)

    def _parent_alive(self) -> bool:
        # Orphans are re-parented (to init or a subreaper): the pid changes.
        if os.getppid() == self.parent_pid:
            return True
        logger.warning("API server (pid %d) is gone; engine core exits", self.parent_pid)
        return False

    def handle_message(self, kind: int, payload: Any) -> None:
        if kind in (EngineCoreRequestType.ADD, EngineCoreRequestType.ABORT):
            self.stats_dirty = True
        if kind == EngineCoreRequestType.ADD:
            errors = []
            for item in payload:
                try:
                    req = EngineCoreRequest.decode(item)
                    self.core.add_request(Request(
                        req.req_id, req.prompt_token_ids, req.sampling_params,
                        arrival_time=req.arrival_time, priority=req.priority,
                        cache_salt=req.cache_salt, pooling_params=req.pooling_params,
                    ))
                except InvalidRequestError as e:  # the request's own fault
                    errors.append(encode_record(RequestError(str(item[0]), str(e), True)))
                except Exception:  # a bug: log it here, keep serving the others
                    logger.exception("adding request %r failed", item[0] if item else None)
                    errors.append(encode_record(
                        RequestError(str(item[0]) if item else "", "internal error", False)))
            if errors:
                self.output_socket.send(encode(EngineCoreMessageType.REQUEST_ERRORS, errors))
        elif kind == EngineCoreRequestType.ABORT:
            self.core.abort_requests(payload)
        else:
            logger.error("unknown message type %r", kind)

    def send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        steps: dict[int, list[Any]] = {}
        payload = {"outputs": [encode_record(o, steps) for o in outputs], "steps": steps,
                   "stats": encode_record(self.core.get_stats())}
        self.output_socket.send(encode(EngineCoreMessageType.OUTPUTS, payload))
        self.stats_dirty = False


def run_engine_core(config: EngineConfig, eos_token_id: int | None, input_address: str,
                    output_address: str, parent_pid: int, log_level: int = logging.INFO) -> None:
    """Entry point of the engine-core process: build, handshake, serve."""
    select_rank_devices(config.parallel_config)
    # Ctrl-C reaches the whole process group; the API server shuts this process down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # JAX probing for a TPU on every machine without one is not news.
    logging.getLogger("jax._src.xla_bridge").setLevel(max(log_level, logging.WARNING))
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s [engine core] "
                        "%(name)s: %(message)s", datefmt="%H:%M:%S")
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.PULL)
    input_socket.setsockopt(zmq.RCVHWM, 0)
    input_socket.connect(input_address)
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)
    output_socket.setsockopt(zmq.LINGER, 2000)
    output_socket.connect(output_address)
    try:
        from jaxserve.engine.build import build_engine_core  # imports JAX

        built = build_engine_core(config, eos_token_id)
        freeze_gc_heap()  # a dedicated process: start-up objects never need collecting
        sc = built.config.scheduler_config
        ready = EngineReady(
            num_blocks=built.num_blocks, block_size=built.config.cache_config.block_size,
            vocab_size=built.worker.arch.vocab_size, max_num_seqs=sc.max_num_seqs,
            timings=built.timings, resolved=built.resolved,
        )
    except Exception as e:  # noqa: BLE001 - reported to the API server, then exit
        logger.error("engine core failed to start:\n%s", traceback.format_exc())
        output_socket.send(encode(EngineCoreMessageType.STARTUP_FAILED, f"{type(e).__name__}: {e}"))
        output_socket.close()
        sys.exit(1)
    output_socket.send(encode(EngineCoreMessageType.READY, encode_record(ready)))
    proc = EngineCoreProc(built.core, input_socket, output_socket, parent_pid)
    try:
        proc.run_busy_loop()
    except Exception as e:  # noqa: BLE001 - the API server fails in-flight requests
        logger.error("engine core died:\n%s", traceback.format_exc())
        output_socket.send(encode(EngineCoreMessageType.ENGINE_ERROR, f"{type(e).__name__}: {e}"))
        output_socket.close()
        _release_followers(built)
        sys.exit(1)
    _release_followers(built)
    input_socket.close(linger=0)
    output_socket.close(linger=0)
    ctx.term()


def _release_followers(built: Any) -> None:
    """Multi-host: tell the processes following this one to stop (best effort on the way out:
    if they are stuck in a collective, nothing can reach them)."""
    stop = getattr(built.core.worker, "shutdown", None)
    if stop is not None:
        try:
            stop()
        except Exception:  # noqa: BLE001 - exiting anyway
            logger.exception("could not release the follower processes")


def select_rank_devices(parallel: ParallelConfig) -> None:
    """Before JAX starts, on GPUs: this data-parallel rank's slice of CUDA_VISIBLE_DEVICES
    keeps XLA from reserving memory on the other ranks' devices. (Elsewhere make_mesh takes
    the rank's slice of the devices it sees, from `parallel.data_parallel_rank`.)"""
    rank, size = parallel.data_parallel_rank, parallel.data_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if size > 1 and visible:
        ids = visible.split(",")
        per = len(ids) // size
        if per:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[rank * per : (rank + 1) * per])


def launch_engine_core(config: EngineConfig, eos_token_id: int | None, input_address: str,
                       output_address: str, log_level: int = logging.INFO, dp_rank: int = 0,
                       ) -> multiprocessing.process.BaseProcess:
    """Start the engine-core process of data-parallel rank `dp_rank` (spawn: a fresh
    interpreter, JAX imported only there); its config says which rank it is."""
    config = dataclasses.replace(config, parallel_config=dataclasses.replace(
        config.parallel_config, data_parallel_rank=dp_rank))
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=run_engine_core, name=f"EngineCore_DP{dp_rank}",
        args=(config, eos_token_id, input_address, output_address, os.getpid(), log_level),
        daemon=True,
    )
    proc.start()
    return proc
