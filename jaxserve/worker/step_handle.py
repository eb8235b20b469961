"""What one dispatched step hands back, how its outputs reach the host, and what the worker
tells traces about it.

`StepHandle.result()` is the step's only device sync. `CompileMonitor` counts the programs
JAX builds (traces, lowerings, compiles) so a step that compiled is visible in its trace and
in the live counters: after warm-up that number should stay 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import jax
import numpy as np
from jax import monitoring

from jaxserve.engine_core.model_runner_output import LogprobsLists, ModelRunnerOutput

if TYPE_CHECKING:  # types only: the pooler imports this module (host_array)
    from jaxserve.worker.input_batch import StepInputs
    from jaxserve.worker.model_runner import ModelRunner
    from jaxserve.worker.pooler import PoolingRows, PoolSegments
    from jaxserve.worker.sampler import SamplerOutput
    from jaxserve.worker.sampler_inputs import SamplerInputs


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
    def _on_event(cls, event: str, duration_secs: float, **_: str | int) -> None:
        if event.startswith("/jax/core/compile/"):
            cls.seconds += duration_secs
            if event == "/jax/core/compile/jaxpr_trace_duration":
                cls.count += 1  # one per program built (cached on disk or not)


@dataclass
class StepFacts:
    """A step's facts for its trace (ModelRunnerOutput's sample_s / num_compiles / compile_s)."""

    sample_s: float = 0.0
    num_compiles: int = 0
    compile_s: float = 0.0


@dataclass(frozen=True)
class PromptLogprobRows:
    """Where one request's prompt-logprob rows sit in a step: flat token rows
    [start, start + count) give prompt positions first.. (each row predicts the next token)."""

    req_id: str
    first_position: int
    start: int
    count: int
    num_logprobs: int


class PromptLogprobTargets(NamedTuple):
    """A step's prompt-logprob work on the host: each token row's target (the next prompt
    token; 0 on rows no request asked for) and the requests' rows."""

    targets: np.ndarray  # i32[T]
    rows: list[PromptLogprobRows]


@dataclass(frozen=True)
class PromptLogprobsOut:
    """The prompt-logprobs program's outputs (on the device) and the rows they answer."""

    token_ids: jax.Array  # i32[T, 1 + MAX_LOGPROBS]: the target, then the top-N
    logprobs: jax.Array  # f32[T, 1 + MAX_LOGPROBS]
    ranks: jax.Array  # i32[T]: the target's rank
    rows: list[PromptLogprobRows]


@dataclass(frozen=True)
class PoolOut:
    """The pooling program's outputs (on the device) and the pooling requests they answer."""

    sums: jax.Array  # f32[max_num_seqs, H]: `pool_sums` per pooling request
    rows: list[PoolingRows]
    every_token: jax.Array | None  # [T, H] final states, when token_embed reads them


@dataclass
class PreparedStep:
    """One step between its phases (ModelRunner: prepare -> forward -> sampler -> handle)."""

    req_ids: list[str]  # the scheduled requests, in batch order
    inp: StepInputs[np.ndarray]  # padded token ids, positions, slot mapping, pages, ...
    slots: np.ndarray  # each request's batch slot
    samples: np.ndarray  # whether each request samples a token this step
    T: int  # the token bucket
    R: int  # the sampled-rows bucket
    sampler: SamplerInputs  # the packed per-row inputs, the mode, processors or not
    per_req: np.ndarray | None  # rows per request in a verification step (None: one each)
    prompt: PromptLogprobTargets | None  # prompt-logprob targets and rows, if any asked
    pool: PoolSegments | None = None  # Pooler.segments: embedding requests

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
    prompt_out: PromptLogprobsOut | None = None
    pool_out: PoolOut | None = None
    facts: StepFacts = field(default_factory=StepFacts)
    # Each request's first sampled position, when the batch keeps sampled tokens (n-gram drafts).
    first_positions: np.ndarray | None = None
    _result: ModelRunnerOutput | None = field(default=None, init=False, repr=False)

    def result(self) -> ModelRunnerOutput:
        if self._result is None:
            self._result = self.runner.read_output(self)
        return self._result


def host_array(x: jax.Array) -> np.ndarray:
    """A replicated array on the host; across processes, this process's own copy."""
    return np.asarray(x.addressable_data(0))


def sampled_output(step: PreparedStep, out: SamplerOutput, num_logprobs: np.ndarray
                   ) -> ModelRunnerOutput:
    """Each request's sampled tokens on the host: one, or in a verification step
    (`step.per_req` rows each) its accepted drafts and final token; and the logprobs asked
    for (a request with logprobs has one row, having no drafts)."""
    req_ids, samples, per_req = step.req_ids, step.samples, step.per_req
    n = len(req_ids)
    if per_req is None:
        tokens = host_array(out.sampled)[:n].tolist()
        sampled = [[t] if s else [] for t, s in zip(tokens, samples)]
        first: slice | np.ndarray = slice(0, n)
    else:
        assert out.emitted is not None  # the rejection sampler's
        ends = np.cumsum(per_req)
        starts = ends - per_req
        tok, emitted = host_array(out.sampled)[: ends[-1]], host_array(out.emitted)[: ends[-1]]
        sampled = [tok[a:b][emitted[a:b]].tolist() if s else []
                   for a, b, s in zip(starts.tolist(), ends.tolist(), samples)]
        first = starts
    logprobs = None
    if (num_logprobs >= 0).any():
        ids = host_array(out.logprob_token_ids)[first]
        lps = host_array(out.logprobs)[first]
        ranks = host_array(out.sampled_ranks)[first]
        k = num_logprobs.tolist()
        logprobs = LogprobsLists(
            token_ids=[ids[i, : 1 + max(k[i], 0)].tolist() for i in range(n)],
            logprobs=[lps[i, : 1 + max(k[i], 0)].tolist() for i in range(n)],
            sampled_token_ranks=ranks.tolist(),
        )
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled, logprobs=logprobs)


def prompt_logprobs_output(out: PromptLogprobsOut) -> dict[str, tuple[int, LogprobsLists]]:
    """Each prompt_logprobs request's rows on the host: (first position, logprobs)."""
    ids, lps, ranks = host_array(out.token_ids), host_array(out.logprobs), host_array(out.ranks)
    result = {}
    for r in out.rows:
        sl, k = slice(r.start, r.start + r.count), 1 + r.num_logprobs
        result[r.req_id] = (r.first_position, LogprobsLists(
            ids[sl, :k].tolist(), lps[sl, :k].tolist(), ranks[sl].tolist()))
    return result
