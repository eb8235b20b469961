"""`EngineClient` (vLLM's `vllm/engine/protocol.py`): what the API server codes against.

Two classes stand in for each other behind it, chosen by --data-parallel-size:

    EngineClient ◀── AsyncMPClient       one engine-core process (core_client.py)
                 ◀── DPLBAsyncMPClient   one AsyncMPClient per data-parallel rank, each new
                                          request to the least-loaded one (dp_client.py)

A structural `Protocol`, not a base class: the type checker holds both to the same
signatures wherever the server takes an `EngineClient` (ServingContext.client, run_server).
JAX-free, like the API server.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from jaxserve.engine.messages import EngineReady
from jaxserve.outputs import EmbeddingRequestOutput, RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.request_trace import RequestTrace
from jaxserve.sampling_params import SamplingParams


class EngineClient(Protocol):
    """The engine as the API server sees it: a life cycle, liveness, `generate` and
    `encode`."""

    # --- life cycle -------------------------------------------------------------------

    async def wait_until_ready(self) -> EngineReady:
        """Wait for the engine's READY; raise EngineStartupError if it dies first."""
        ...

    def start(self) -> None:
        """Start routing outputs and watching the engine process (call once ready)."""
        ...

    def fail_in_flight(self, reason: str) -> None:
        """End every in-flight request with a 503 `reason` (the server is stopping)."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine process and release its sockets (idempotent)."""
        ...

    # --- liveness ---------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        """False once the engine is gone (dead_error says why)."""
        ...

    @property
    def dead_error(self) -> str | None:
        """Why the engine is gone; None while it is alive."""
        ...

    # Called once, with dead_error, when the engine dies (the server then exits).
    on_dead: Callable[[str], None] | None

    # --- requests ---------------------------------------------------------------------

    # NOTE: plain `def`s returning the generator: the implementations are `async def`s that
    # yield, whose type is exactly this (an `async def` here would be a coroutine of one).
    def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, *, priority: int = 0,
                 arrival_time: float | None = None,
                 trace: RequestTrace | None = None,
                 ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's RequestOutput as it grows, the last one finished. Closing the
        generator before the end aborts the request in the engine. Raises EngineDeadError
        when the engine is gone, RequestRejectedError when it refuses the request."""
        ...

    def encode(self, request_id: str, prompt_token_ids: list[int],
               pooling_params: PoolingParams, *, priority: int = 0,
               arrival_time: float | None = None,
               trace: RequestTrace | None = None,
               ) -> AsyncGenerator[EmbeddingRequestOutput, None]:
        """A pooling request (embed, classify, score): yield its one EmbeddingRequestOutput,
        finished. Errors as generate's."""
        ...
