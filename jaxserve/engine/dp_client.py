"""Data parallelism: one engine-core process per rank, requests balanced by load.

Each rank has its own devices, KV cache and scheduler; the API server sends a
new request to the rank with the fewest requests in flight, and everything about
that request (outputs, abort) stays with its rank.

    API server ──▶ DPLBAsyncMPClient ──▶ AsyncMPClient[0] ──▶ engine core rank 0
                                     └─▶ AsyncMPClient[1] ──▶ engine core rank 1
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing

from jaxserve.engine.core_client import AsyncMPClient, EngineDeadError
from jaxserve.engine.messages import EngineReady
from jaxserve.outputs import EmbeddingRequestOutput, RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.request_trace import RequestTrace
from jaxserve.sampling_params import SamplingParams


class DPLBAsyncMPClient:
    """The EngineClient (jaxserve/engine/protocol.py) over several data-parallel engine
    cores, load-balanced here (vLLM's DPLBAsyncMPClient)."""

    def __init__(self, clients: list[AsyncMPClient]) -> None:
        self.clients = clients
        self.routed = [0] * len(clients)  # requests sent to each rank

    async def wait_until_ready(self) -> EngineReady:
        """All ranks ready; reports the smallest KV cache among them."""
        ready = await asyncio.gather(*(c.wait_until_ready() for c in self.clients))
        return min(ready, key=lambda r: r.num_blocks)

    def start(self) -> None:
        for c in self.clients:
            c.start()

    def fail_in_flight(self, reason: str) -> None:
        for c in self.clients:
            c.fail_in_flight(reason)

    async def shutdown(self) -> None:
        await asyncio.gather(*(c.shutdown() for c in self.clients))

    @property
    def is_alive(self) -> bool:
        return all(c.is_alive for c in self.clients)

    @property
    def dead_error(self) -> str | None:
        return next((c.dead_error for c in self.clients if c.dead_error), None)

    @property
    def on_dead(self) -> Callable[[str], None] | None:
        return self.clients[0].on_dead

    @on_dead.setter
    def on_dead(self, fn: Callable[[str], None] | None) -> None:
        for c in self.clients:
            c.on_dead = fn

    @property
    def num_in_flight(self) -> int:
        return sum(c.num_in_flight for c in self.clients)

    def _route(self) -> AsyncMPClient:
        """The least-loaded rank's client (ties: the lowest rank).

        NOTE: the rank is chosen when iteration starts, and the rank's client
        registers the request before its first await, so concurrent requests see
        each other's load.
        """
        if not self.is_alive:
            raise EngineDeadError(self.dead_error)
        rank = min(range(len(self.clients)), key=lambda i: self.clients[i].num_in_flight)
        self.routed[rank] += 1
        client = self.clients[rank]
        if client.metrics is not None:
            client.metrics.record_routed(rank)
        return client

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, *, priority: int = 0,
                       arrival_time: float | None = None,
                       trace: RequestTrace | None = None,
                       ) -> AsyncGenerator[RequestOutput, None]:
        """AsyncMPClient.generate on the least-loaded rank."""
        gen = self._route().generate(request_id, prompt, prompt_token_ids, params,
                                     priority=priority, arrival_time=arrival_time, trace=trace)
        async with aclosing(gen):  # a consumer that stops early aborts the request there
            async for out in gen:
                yield out

    async def encode(self, request_id: str, prompt_token_ids: list[int],
                     pooling_params: PoolingParams, *, priority: int = 0,
                     arrival_time: float | None = None,
                     trace: RequestTrace | None = None,
                     ) -> AsyncGenerator[EmbeddingRequestOutput, None]:
        """AsyncMPClient.encode on the least-loaded rank."""
        gen = self._route().encode(request_id, prompt_token_ids, pooling_params,
                                   priority=priority, arrival_time=arrival_time, trace=trace)
        async with aclosing(gen):  # a consumer that stops early aborts the request there
            async for out in gen:
                yield out
