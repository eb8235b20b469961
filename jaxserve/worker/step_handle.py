"""What one dispatched step hands back, and what the worker tells traces about it.

`StepHandle.result()` is the step's only device sync. `CompileMonitor` counts the programs
JAX builds (traces, lowerings, compiles) so a step that compiled is visible in its trace and
in the live counters: after warm-up that number should stay 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from jax import monitoring

from jaxserve.engine_core.model_runner_output import ModelRunnerOutput

if TYPE_CHECKING:
    from jaxserve.worker.model_runner import ModelRunner
    from jaxserve.worker.sampler import SamplerOutput


class CompileMonitor:
    """Process-wide counts of JAX program builds: one listener per process, registered on
    first use (JAX's listeners are process-wide too)."""

    count = 0
    seconds = 0.0
    _registered = False

    @classmethod
    def install(cls) -> None:
        if not cls._registered:
            monitoring.register_event_duration_secs_listener(cls._on_event)
            cls._registered = True

    @classmethod
    def _on_event(cls, name: str, secs: float, **_: Any) -> None:
        if name.startswith("/jax/core/compile/"):
            cls.seconds += secs
            if name == "/jax/core/compile/jaxpr_trace_duration":
                cls.count += 1  # one per program built (cached on disk or not)


@dataclass
class StepFacts:
    """A step's facts for its trace (ModelRunnerOutput's sample_s / num_compiles / compile_s)."""

    sample_s: float = 0.0
    num_compiles: int = 0
    compile_s: float = 0.0


@dataclass
class PreparedStep:
    """One step between its phases (ModelRunner: prepare -> forward -> sampler -> handle)."""

    req_ids: list[str]  # the scheduled requests, in batch order
    inp: Any  # StepInputs: padded token ids, positions, slot mapping, pages, ...
    slots: np.ndarray  # each request's batch slot
    samples: np.ndarray  # whether each request samples a token this step
    T: int  # the token bucket
    R: int  # the sampled-rows bucket
    mode: Any  # SamplerMode
    sampler_inputs: np.ndarray  # the sampler's packed per-row inputs
    per_req: np.ndarray | None  # rows per request in a verification step (None: one each)
    prompt: tuple[Any, list[Any]] | None  # prompt-logprob targets and rows, if any asked

    @property
    def verify(self) -> bool:
        return self.per_req is not None


@dataclass
class StepHandle:
    """A dispatched step: its prepared inputs and its device outputs. `result()` reads them
    once, through `ModelRunner.read_output` (the step's only device sync)."""

    runner: ModelRunner
    step: PreparedStep | None  # None: nothing was scheduled
    out: SamplerOutput | None = None
    num_logprobs: np.ndarray | None = None  # each request's top-logprobs count (-1: none)
    prompt_out: tuple[Any, list[PromptLogprobRows]] | None = None
    facts: StepFacts = field(default_factory=StepFacts)
    # Each request's first sampled position, when the batch keeps sampled tokens (n-gram drafts).
    first_positions: np.ndarray | None = None
    _result: ModelRunnerOutput | None = field(default=None, init=False, repr=False)

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            self._result = self.runner.read_output(self)
        return self._result


@dataclass(frozen=True)
class PromptLogprobRows:
    """Where one request's prompt-logprob rows sit in a step: flat token rows
    [start, start + count) give prompt positions first.. (each row predicts the next token)."""

    req_id: str
    first_position: int
    start: int
    count: int
    num_logprobs: int


