"""The API server's side of the engine core: ZeroMQ sockets, output routing, liveness.

    generate() ──ADD──▶ engine core ──OUTPUTS──▶ output loop ──▶ OutputProcessor
        ▲                                                      (detokenize, stop strings)
        └──────────── per-request asyncio.Queue ◀──────────────────────┘

`generate` is an async generator: the request enters the engine on the first
iteration and is aborted there (pages freed) when the consumer stops early,
e.g. because the HTTP client went away. If the engine process dies, every
in-flight request gets an EngineDeadError and `on_dead` is called.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing.process
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from jaxserve.engine.messages import (
    EngineCoreMessageType,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineReady,
    RequestError,
    decode,
    encode,
    remove_ipc_files,
)
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.processor import POOLING_SAMPLING_PARAMS
from jaxserve.engine_core.core_outputs import EngineCoreOutput
from jaxserve.engine_core.stats import SchedulerStats
from jaxserve.engine_core.step_trace import StepTrace
from jaxserve.engine_core.wire import decode_record, encode_record
from jaxserve.metrics.prometheus import RequestStateStats, ServerMetrics
from jaxserve.metrics.trace_store import TraceStore
from jaxserve.outputs import EmbeddingRequestOutput, RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.request_trace import RequestTrace
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OutputT = TypeVar("OutputT", RequestOutput, EmbeddingRequestOutput)


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; nothing more will be generated."""


class RequestRejectedError(Exception):
    """The engine core refused a request as invalid (the request's own fault)."""


class EngineStartupError(RuntimeError):
    """The engine-core process failed before it was ready."""


class AsyncMPClient:
    """The EngineClient (jaxserve/engine/protocol.py) of one engine-core process (vLLM's
    AsyncMPClient); lives in the API server's event loop."""

    def __init__(self, tokenizer: Any, process: multiprocessing.process.BaseProcess,
                 input_address: str, output_address: str, metrics: ServerMetrics | None = None,
                 engine_index: int = 0, traces: TraceStore | None = None) -> None:
        self.process = process
        self.engine_index = engine_index  # data-parallel rank
        self.metrics = metrics
        self.traces = traces or TraceStore(enabled=False)
        self.output_processor = OutputProcessor(tokenizer, self.traces.enabled)
        self._sync_ctx = zmq.Context()
        # Input: a plain socket, so that abort() can send synchronously from a
        # `finally` of a cancelled task (no await). HWM 0: never drop or block.
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._addresses = (input_address, output_address)  # ipc files this side owns
        self._input.bind(input_address)
        self._ctx = zmq.asyncio.Context()
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)
        self._queues: dict[str, asyncio.Queue[RequestOutput | EmbeddingRequestOutput
                                              | BaseException]] = {}
        self._children: dict[str, str] = {}  # engine request id -> request id
        self._req_stats: dict[str, RequestStateStats] = {}  # by engine request id
        self._tasks: list[asyncio.Task[None]] = []
        self.ready: EngineReady | None = None
        self.dead_error: str | None = None
        self.on_dead: Callable[[str], None] | None = None
        self._closed = False

    # --- life cycle -------------------------------------------------------------------

    async def wait_until_ready(self) -> EngineReady:
        """Wait for the engine's READY; raise EngineStartupError if it dies first."""
        while True:
            if await self._output.poll(500):
                kind, payload = decode(await self._output.recv())
                if kind == EngineCoreMessageType.READY:
                    self.ready = decode_record(EngineReady, payload)
                    return self.ready
                if kind == EngineCoreMessageType.STARTUP_FAILED:
                    self.process.join(10)
                    raise EngineStartupError(payload)
                logger.warning("unexpected message %r before READY", kind)
            elif not self.process.is_alive():
                raise EngineStartupError(
                    f"engine core process exited with code {self.process.exitcode} before it was ready")

    def start(self) -> None:
        """Start routing outputs and watching the process (call once ready)."""
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._output_loop(), name="engine-output-loop"))
        loop.add_reader(self.process.sentinel, self._on_process_exit)

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None

    def fail_in_flight(self, reason: str) -> None:
        """End every in-flight request with a 503 `reason` (the server is stopping): streams
        send their error and [DONE] instead of being cut off."""
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
        self._queues.clear()

    async def shutdown(self) -> None:
        """Stop the engine process, close the sockets and remove their files (idempotent;
        the files go whatever else fails on the way)."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                asyncio.get_running_loop().remove_reader(self.process.sentinel)
            except (RuntimeError, ValueError):
                pass
            for t in self._tasks:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self.process.is_alive():
                try:
                    self._send(EngineCoreRequestType.SHUTDOWN, None)
                except zmq.ZMQError:
                    # Alive but no longer connected: it is exiting already (after a fault,
                    # its interpreter's teardown can outlast the grace period on a busy
                    # machine); _stop_process waits for it, then terminates it.
                    pass
            await asyncio.get_running_loop().run_in_executor(None, self._stop_process)
        finally:
            self._input.close()
            self._output.close()
            self._ctx.term()
            self._sync_ctx.term()
            remove_ipc_files(*self._addresses)

    def _stop_process(self) -> None:
        """Wait for the engine process to exit (told to, or exiting), then terminate it,
        then kill it."""
        self.process.join(5)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    # --- requests ---------------------------------------------------------------------

    def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, *, priority: int = 0,
                 arrival_time: float | None = None,
                 trace: RequestTrace | None = None,
                 ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's RequestOutput as it grows, the last one finished.

        When several outputs arrived since the previous iteration, only the
        newest is yielded (outputs are cumulative). `trace`: the request's trace so far
        (TraceStore.new); the engine core and this client add to it."""
        return self._stream(RequestOutput, request_id, prompt, prompt_token_ids, params,
                            priority, arrival_time, trace, None)

    def encode(self, request_id: str, prompt_token_ids: list[int],
               pooling_params: PoolingParams, *, priority: int = 0,
               arrival_time: float | None = None,
               trace: RequestTrace | None = None,
               ) -> AsyncGenerator[EmbeddingRequestOutput, None]:
        """Yield the pooling request's one EmbeddingRequestOutput, finished."""
        return self._stream(EmbeddingRequestOutput, request_id, None, prompt_token_ids,
                            POOLING_SAMPLING_PARAMS, priority, arrival_time, trace,
                            pooling_params)

    async def _stream(self, kind: type[OutputT], request_id: str, prompt: str | None,
                      prompt_token_ids: list[int], params: SamplingParams, priority: int,
                      arrival_time: float | None, trace: RequestTrace | None,
                      pooling_params: PoolingParams | None) -> AsyncGenerator[OutputT, None]:
        """generate / encode: the request's outputs, which are `kind` (EmbeddingRequestOutput
        with `pooling_params`, else RequestOutput)."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_error)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.traces.start(trace)
        try:
            queue = self._add_request(request_id, prompt, prompt_token_ids, params, priority,
                                      arrival_time, trace, pooling_params)
        except BaseException:
            self.traces.finish(trace, "not sent")
            raise
        finished = False
        reason: str | None = "abort"  # how it ended, for its trace (None: it finished)
        respond_s, first, last, n = 0.0, 0.0, 0.0, 0
        try:
            while True:
                item = await queue.get()
                while not queue.empty() and not isinstance(item, BaseException):
                    item = queue.get_nowait()
                if isinstance(item, BaseException):
                    finished, reason = True, f"error: {type(item).__name__}"
                    raise item  # nothing left in the engine to abort
                if not isinstance(item, kind):  # a bug: outputs follow the request's kind
                    raise TypeError(f"{request_id}: expected {kind.__name__}, got "
                                    f"{type(item).__name__}")
                finished = item.finished
                # The time the consumer takes with each output (formatting, sending) is the
                # API server's part of the response.
                t = time.time()
                first = first or t
                yield item
                last = time.time()
                respond_s, n = respond_s + last - t, n + 1
                if finished:
                    reason = None
                    return
        finally:
            if not finished:
                self.abort(request_id)
            if trace is not None:
                if n:
                    trace.add("api_server", "respond", first, last, outputs=n, busy_s=respond_s)
                self.traces.finish(trace, reason)

    def _add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                     params: SamplingParams, priority: int, arrival_time: float,
                     trace: RequestTrace | None = None,
                     pooling_params: PoolingParams | None = None,
                     ) -> asyncio.Queue[RequestOutput | EmbeddingRequestOutput | BaseException]:
        """Register the request and send it; nothing stays registered if either fails."""
        children = self.output_processor.add_request(request_id, prompt, prompt_token_ids, params,
                                                     trace, pooling_params)
        queue: asyncio.Queue[RequestOutput | EmbeddingRequestOutput | BaseException] = \
            asyncio.Queue()
        try:
            frame = encode(EngineCoreRequestType.ADD, [
                encode_record(EngineCoreRequest(cid, prompt_token_ids, p, arrival_time, priority,
                                                pooling_params=pooling_params))
                for cid, p in children])
            self._queues[request_id] = queue
            for cid, _ in children:
                self._children[cid] = request_id
                self._req_stats[cid] = RequestStateStats(arrival_time, len(prompt_token_ids),
                                                         engine=self.engine_index)
            self._input.send(frame, zmq.NOBLOCK)
            if self.metrics is not None and pooling_params is None:
                self.metrics.record_request_params(len(children), params.max_tokens,
                                                   self.engine_index)
            if trace is not None:
                trace.add("engine_core", "sent", time.time(), engine=self.engine_index)
        except BaseException:
            self.output_processor.abort_request(request_id)
            self._queues.pop(request_id, None)
            for cid, _ in children:
                self._children.pop(cid, None)
                self._req_stats.pop(cid, None)
            raise
        return queue

    def abort(self, request_id: str) -> None:
        """Forget a request here and abort its sequences in the engine (frees their pages)."""
        child_ids = self.output_processor.child_ids(request_id)
        self.output_processor.abort_request(request_id)
        self._queues.pop(request_id, None)
        for cid in child_ids:
            self._finish_child(cid, "abort")
        if child_ids and self.is_alive:
            self._send(EngineCoreRequestType.ABORT, child_ids)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        self._input.send(encode(kind, payload), zmq.NOBLOCK)

    # --- outputs ----------------------------------------------------------------------

    async def _output_loop(self) -> None:
        try:
            while True:
                kind, payload = decode(await self._output.recv())
                if kind == EngineCoreMessageType.OUTPUTS:
                    self._process_outputs(payload)
                elif kind == EngineCoreMessageType.REQUEST_ERRORS:
                    for e in (decode_record(RequestError, v) for v in payload):
                        error = (RequestRejectedError(e.message) if e.own_fault
                                 else RuntimeError(f"the engine core failed to add it: {e.message}"))
                        self._fail_request(self._children.get(e.req_id), error)
                elif kind == EngineCoreMessageType.ENGINE_ERROR:
                    self._mark_dead(f"engine core failed: {payload}")
                else:
                    logger.error("unexpected message type %r from the engine core", kind)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not leave requests hanging
            logger.exception("output loop failed")
            self._mark_dead("the API server's output loop failed")

    def _process_outputs(self, payload: dict[str, Any]) -> None:
        steps = {int(k): decode_record(StepTrace, v) for k, v in (payload.get("steps") or {}).items()}
        outputs = [decode_record(EngineCoreOutput, d, steps) for d in payload["outputs"]]
        now = time.monotonic()
        if self.metrics is not None:
            for out in outputs:
                s = self._req_stats.get(out.req_id)
                if s is not None:
                    self.metrics.record_output(s, out, now)
            self.metrics.end_iteration(self.engine_index)
        results, to_abort = self.output_processor.process_outputs(outputs)
        for out in outputs:
            if out.finish_reason is not None:
                self._finish_child(out.req_id, out.finish_reason.value, now)
        if to_abort:  # stopped by a stop string: the engine does not know yet
            for cid in to_abort:
                self._finish_child(cid, "stop", now)
            self._send(EngineCoreRequestType.ABORT, to_abort)
        for r in results:
            queue = self._queues.get(r.request_id)
            if queue is not None:
                queue.put_nowait(r)
            if r.finished:
                self._queues.pop(r.request_id, None)
        if payload.get("stats") is not None and self.metrics is not None:
            self.metrics.record_scheduler_stats(decode_record(SchedulerStats, payload["stats"]),
                                                self.engine_index)

    def _finish_child(self, cid: str, reason: str, now: float | None = None) -> None:
        self._children.pop(cid, None)
        s = self._req_stats.pop(cid, None)
        if s is not None and self.metrics is not None:
            self.metrics.record_finished(s, reason, now)

    def _fail_request(self, request_id: str | None, error: BaseException) -> None:
        if request_id is None:
            return
        queue = self._queues.pop(request_id, None)
        self.abort(request_id)  # its other sequences, if any
        if queue is not None:
            queue.put_nowait(error)

    # --- liveness ---------------------------------------------------------------------

    def _on_process_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self.process.join(1)
        self._mark_dead(f"engine core process died (exit code {self.process.exitcode})")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = reason
        logger.error("%s; failing %d in-flight requests", reason, len(self._queues))
        self.fail_in_flight(reason)
        if self.on_dead is not None:
            self.on_dead(reason)
