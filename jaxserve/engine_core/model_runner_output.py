"""What the worker returns for one step: the contract from worker to scheduler.

Plain dataclasses of Python lists (the worker converts device arrays once per
step), so the scheduler never touches a device array and never imports JAX.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LogprobsLists:
    """Sampled-token log-probabilities, one row per request of `req_ids`.

    Row i: token_ids[i] = [sampled, top-1, ..., top-N],
           logprobs[i]  = their log-probabilities,
           sampled_token_ranks[i] = rank of the sampled token (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]

    def slice(self, start: int, end: int) -> LogprobsLists:
        """Rows start:end, e.g. one request's row for its EngineCoreOutput."""
        return LogprobsLists(
            self.token_ids[start:end],
            self.logprobs[start:end],
            self.sampled_token_ranks[start:end],
        )


@dataclass
class ModelRunnerOutput:
    """Result of executing one SchedulerOutput.

    `sampled_token_ids[req_id_to_index[r]]` is the list of tokens sampled for
    request r this step: one token, or [] when r's scheduled chunk did not reach
    the end of its known tokens (a partial prefill; its logits are discarded).
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsLists | None = None
    # req_id -> (prompt position of the first row, rows): row j is the logprob of prompt
    # token first + j + 1 given the tokens before it, then the top-N (prompt_logprobs).
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]] | None = None
    # req_id -> the result of a pooling request whose prompt this step finished (worker/pooler.py).
    pooler_output: dict[str, list[float] | list[list[float]]] | None = None
    # For traces: the sampler's device seconds (estimated per bucket at warm-up; 0 unknown),
    # and programs compiled while this step was dispatched (0 once everything is warm).
    sample_s: float = 0.0
    num_compiles: int = 0
    compile_s: float = 0.0


# Returned for a step that scheduled no tokens (it only carried finished ids).
EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
