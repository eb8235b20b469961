"""Messages between the API server and the engine-core process (ZeroMQ + msgpack).

Two PUSH/PULL pairs, both bound by the API server (it outlives the engine):

    API server  PUSH ──[ADD | ABORT | SHUTDOWN]─────────▶ PULL  engine core
    API server  PULL ◀─[READY | OUTPUTS | ...]────────── PUSH  engine core

Every frame is `msgpack([type, payload])`, made only of lists, dicts, str,
int, float and None. JAX-free: both processes import it.
"""

from __future__ import annotations

import atexit
import enum
import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

import msgpack

from jaxserve.config import ResolvedConfig
from jaxserve.engine_core.request import InvalidRequestError
from jaxserve.engine_core.wire import decode_record
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams


class EngineCoreRequestType(enum.IntEnum):
    """API server -> engine core (vLLM's names)."""

    ADD = 0  # payload: [encode_record(EngineCoreRequest), ...] (jaxserve/engine_core/wire.py)
    ABORT = 1  # payload: [engine request id, ...]
    SHUTDOWN = 3  # payload: None; the engine core leaves its loop and exits


class EngineCoreMessageType(enum.IntEnum):
    """Engine core -> API server."""

    READY = 0  # payload: encode_record(EngineReady)
    # payload: {"outputs": [encode_record(EngineCoreOutput, steps)],
    #           "steps": {step: encode_record(StepTrace)}, "stats": encode_record(SchedulerStats)}
    OUTPUTS = 1
    REQUEST_ERRORS = 3  # payload: [encode_record(RequestError), ...]: requests ADD refused
    STARTUP_FAILED = 4  # payload: error message; the process exits next
    ENGINE_ERROR = 5  # payload: error message; the process exits next


@dataclass
class EngineCoreRequest:
    """One sequence to generate (or, with `pooling_params`, to embed), as the engine core
    receives it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float  # time.monotonic() in the API server (same clock in both processes)
    priority: int = 0
    cache_salt: str | None = None
    pooling_params: PoolingParams | None = None

    @classmethod
    def decode(cls, record: list[Any]) -> EngineCoreRequest:
        """`decode_record` for a request; InvalidRequestError for parameters SamplingParams
        refuses (or a malformed record)."""
        try:
            return decode_record(cls, record)
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"invalid sampling parameters: {e}") from None


@dataclass
class EngineReady:
    """What the engine core tells the API server once it can serve."""

    num_blocks: int
    block_size: int
    vocab_size: int
    max_num_seqs: int
    timings: dict[str, float]
    # The settings the engine process resolved (max_model_len, weight format, ...): both
    # processes hold the same record.
    resolved: ResolvedConfig

    @property
    def max_model_len(self) -> int:
        return self.resolved.max_model_len


@dataclass
class RequestError:
    """A request the engine core could not add."""

    req_id: str  # the engine request id
    message: str
    own_fault: bool  # the request's parameters (a 4xx), rather than a bug (a 5xx)


def encode(kind: int, payload: Any) -> bytes:
    return msgpack.packb([int(kind), payload], use_bin_type=True)


def decode(frame: bytes) -> tuple[int, Any]:
    kind, payload = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    return kind, payload


# The ipc socket files this process created and has not removed yet. Removed by whoever
# closes the sockets (AsyncMPClient.shutdown), else at interpreter exit: a server that ends
# through an exception, a signal or a failed start-up leaves nothing in the temp folder.
# Path -> the creating pid: a forked child inherits the table but not the files.
_owned_ipc_files: dict[str, int] = {}


def new_ipc_addresses() -> tuple[str, str]:
    """Fresh ipc:// endpoints (input, output) for one engine core; the calling process owns
    their files (ZeroMQ creates them when it binds) until remove_ipc_files."""
    base = os.path.join(tempfile.gettempdir(), f"jaxserve-{uuid.uuid4().hex[:12]}")
    _owned_ipc_files.update({f"{base}-in": os.getpid(), f"{base}-out": os.getpid()})
    return f"ipc://{base}-in", f"ipc://{base}-out"


def remove_ipc_files(*addresses: str) -> None:
    """Delete the socket files behind ipc:// addresses (the binding side owns them).
    Idempotent: a file already gone is not an error."""
    for address in addresses:
        if address.startswith("ipc://"):
            path = address.removeprefix("ipc://")
            _owned_ipc_files.pop(path, None)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _remove_owned_ipc_files() -> None:
    pid = os.getpid()
    remove_ipc_files(*(f"ipc://{path}" for path, owner in list(_owned_ipc_files.items())
                       if owner == pid))


atexit.register(_remove_owned_ipc_files)
