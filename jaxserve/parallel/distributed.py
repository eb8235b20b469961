"""Multi-host: one JAX process per host under `jax.distributed`, process 0 deciding.

Every process builds the same worker (same weights, same KV cache, same compiled
buckets) over the global mesh. Process 0 runs the engine core; before each step
it broadcasts the SchedulerOutput, and the followers execute the very same step
(JAX is multi-controller: every process must launch every program):

    process 0:  schedule ─▶ broadcast(so) ─▶ execute(so) ─▶ update
    process k:             receive(so)   ─▶ execute(so)

The broadcast is JAX's own `broadcast_one_to_all` over a pickled SchedulerOutput
(plain dataclasses), padded to a power-of-two byte count so it compiles rarely.
"""

from __future__ import annotations

import logging
import os
import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxserve.config import DistributedSettings, ParallelConfig
from jaxserve.engine_core.model_runner_output import ModelRunnerOutput
from jaxserve.engine_core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)


def initialize_distributed(pc: ParallelConfig) -> DistributedSettings:
    """Join the process group once (no-op for one process)."""
    s = pc.distributed()
    if s.num_processes > 1 and not jax.distributed.is_initialized():
        platforms = jax.config.jax_platforms  # type: ignore[attr-defined]  # a flag jax's stubs omit
        if os.environ.get("JAX_PLATFORMS", "") == "cpu" or platforms == "cpu":
            # CPU collectives across processes go through gloo.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(s.coordinator_address, s.num_processes, s.process_id)
        logger.info("process %d of %d joined %s", s.process_id, s.num_processes, s.coordinator_address)
    return s


def _broadcast_bytes(payload: bytes | None) -> bytes:
    """Process 0's bytes on every process (others pass None)."""
    length = np.array([0 if payload is None else len(payload)], np.int64)
    n = int(multihost_utils.broadcast_one_to_all(length)[0])
    size = max(1024, 1 << (max(n, 1) - 1).bit_length())
    buf = np.zeros(size, np.uint8)
    if payload is not None:
        buf[:n] = np.frombuffer(payload, np.uint8)
    return multihost_utils.broadcast_one_to_all(buf)[:n].tobytes()


class LeaderWorker:
    """Process 0's worker: broadcasts each SchedulerOutput, then executes it."""

    def __init__(self, worker) -> None:  # jaxserve.worker.worker.Worker
        self.worker = worker

    def execute_model_async(self, so: SchedulerOutput):
        _broadcast_bytes(pickle.dumps(so))
        return self.worker.execute_model_async(so)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(so).result()

    def shutdown(self) -> None:
        _broadcast_bytes(b"")  # empty = stop


def run_follower(worker) -> int:
    """Execute process 0's steps until it shuts down; returns the number of steps."""
    steps = 0
    while True:
        payload = _broadcast_bytes(None)
        if not payload:
            logger.info("process 0 shut down after %d steps; this process stops following", steps)
            return steps
        so = pickle.loads(payload)
        worker.execute_model(so)  # results stay with process 0
        steps += 1
