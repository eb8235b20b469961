"""N-gram speculative decoding on the host (vLLM's NgramProposer and SpecDecodingStats).

Each step the scheduler asks the proposer for a running request's drafts: if the last
n tokens (n from prompt_lookup_max down to prompt_lookup_min) occurred earlier in its
prompt or output, the tokens that followed that earlier occurrence are proposed. The
worker verifies them in the same forward as the request's next token (one query row per
draft) and keeps the longest accepted prefix plus one token of its own; the scheduler
rolls `num_computed_tokens` back over the rejected ones (their KV is simply overwritten).

    tokens   ... a b c d  x y  a b c      last 3 = "a b c" occurred at 0..2
    drafts                      d x y     (num_speculative_tokens = 3)

NumPy only (the engine core never imports JAX).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.config import SpeculativeConfig
from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxserve.engine_core.request import Request


# Draft tokens one step verifies at most: the verification sampler is compiled for up to
# max_num_seqs + this many rows, and where drafting pays (a step bound by reading weights)
# a few requests' drafts already fill it.
MAX_DRAFT_TOKENS_PER_STEP = 64


class NgramProposer:
    """Prompt-lookup drafts from a request's own tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min or 1
        self.max_n = config.prompt_lookup_max or self.min_n

    def propose_for(self, request: Request, max_drafts: int, max_model_len: int) -> list[int]:
        """Drafts for a decoding request within the step's budget (`max_drafts`), the
        context and max_tokens (the step samples one token beyond its drafts)."""
        if not can_speculate(request.sampling_params):
            return []
        max_drafts = min(max_drafts, max_model_len - 1 - request.num_tokens,
                         request.max_tokens - request.num_output_tokens - 1)
        return self.propose(request.all_token_ids, max_drafts)

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) tokens that followed the most recent earlier occurrence
        of the longest matching suffix; [] when no suffix of min_n tokens recurs."""
        num = min(self.k, max_drafts)
        n_tokens = len(token_ids)
        if num <= 0 or n_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, np.int64)
        # Candidate ends: earlier positions holding the last token (then extend backwards).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if len(ends) == 0:
            return []
        length = np.ones(len(ends), np.int64)
        alive = np.ones(len(ends), bool)
        for j in range(1, self.max_n):
            prev = ends - j
            ok = alive & (prev >= 0)
            ok[ok] &= tokens[prev[ok]] == tokens[n_tokens - 1 - j]
            if not ok.any():
                break
            length += ok
            alive = ok
        best = int(length.max())
        if best < self.min_n:
            return []
        end = int(ends[np.flatnonzero(length == best)[-1]])  # the most recent of the longest
        return tokens[end + 1 : end + 1 + num].tolist()


def can_speculate(params: SamplingParams) -> bool:
    """Requests whose verification would need per-draft sampler state get no drafts:
    penalties (output counts change along the drafts), logprobs (one row per emitted
    token), structured outputs (the grammar must advance over each draft) and bad words of
    several tokens (the sampler checks them against one new token a step)."""
    return (
        params.structured_outputs is None
        and not params.bans_by_history
        and params.logprobs is None
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
    )


class DraftPolicy:
    """Keeps a step's drafts only where they pay, from measured step times.

    Verifying D drafts turns a T-token step into a T + D-token one. Where the forward is
    bound by reading the weights (few tokens) that is nearly free; where it is bound by
    compute (a full batch, or any batch on a CPU) it costs about D/T more. So each step
    compares the expected tokens per second with and without its drafts,

        (sampled + acceptance * D) / time(T + D)   vs   sampled / time(T),

    with time(n) the measured mean step time of n tokens (by power-of-two bucket, as the
    worker pads them) and acceptance the measured accepted fraction of draft tokens. A
    bucket not yet measured is tried once (drafts kept if T + D is the unknown one).
    """

    def __init__(self) -> None:
        self.step_s: dict[int, float] = {}  # token bucket -> moving mean of step seconds
        self.acceptance = 0.5  # moving mean of accepted / proposed draft tokens

    @staticmethod
    def _bucket(num_tokens: int) -> int:
        return 1 << max(num_tokens - 1, 0).bit_length()

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        b = self._bucket(num_tokens)
        old = self.step_s.get(b)
        self.step_s[b] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def observe_drafts(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens:
            self.acceptance = 0.9 * self.acceptance + 0.1 * num_accepted / num_draft_tokens

    def pays(self, num_tokens: int, num_drafts: int, num_sampled: int) -> bool:
        """Whether a step of `num_tokens` tokens (drafts excluded), sampling for
        `num_sampled` requests, gains from `num_drafts` more tokens of drafts."""
        with_drafts = self.step_s.get(self._bucket(num_tokens + num_drafts))
        without = self.step_s.get(self._bucket(num_tokens))
        if with_drafts is None or without is None:
            return with_drafts is None  # measure the unknown one
        return (num_sampled + self.acceptance * num_drafts) / with_drafts > num_sampled / without


class Drafter:
    """The scheduler's side of speculative decoding, one step at a time: drafts for
    decoding requests (within the step's room and `disable_by_batch_size`), dropped unless
    DraftPolicy says they pay, and what verification accepted (stats and policy)."""

    def __init__(self, config: SpeculativeConfig, max_num_seqs: int) -> None:
        self.proposer = NgramProposer(config)
        self.policy = DraftPolicy()
        self.batch_limit = config.disable_by_batch_size or max_num_seqs
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        self.step_drafts: dict[str, list[int]] = {}  # this step's, by request id
        self._room = MAX_DRAFT_TOKENS_PER_STEP  # drafts this step may still take

    def start_step(self) -> None:
        self.step_drafts = {}
        self._room = MAX_DRAFT_TOKENS_PER_STEP

    def propose(self, request: Request, num_running: int, token_budget: int,
                max_model_len: int) -> list[int]:
        """Drafts for a decoding request (it then computes 1 + len(drafts) tokens)."""
        if num_running > self.batch_limit:
            return []
        drafts = self.proposer.propose_for(request, min(token_budget - 1, self._room),
                                           max_model_len)
        self._room -= len(drafts)
        return drafts

    def give_back(self, drafts: list[int] | None) -> None:
        """Proposed drafts that were not scheduled (their request preempted itself)."""
        self._room += len(drafts or ())

    def drop(self, req_id: str) -> None:
        """A scheduled request taken back out of the step (preempted)."""
        self._room += len(self.step_drafts.pop(req_id, ()))

    def keep_if_they_pay(self, token_budget: int, max_tokens: int,
                         num_scheduled: dict[str, int]) -> int:
        """Drop the step's drafts unless DraftPolicy expects them to raise tokens/s; their
        pages stay allocated (the request grows into them). Returns the budget left."""
        num_drafts = sum(map(len, self.step_drafts.values()))
        if not num_drafts or self.policy.pays(max_tokens - token_budget - num_drafts,
                                              num_drafts, len(num_scheduled)):
            return token_budget
        for req_id, drafts in self.step_drafts.items():
            num_scheduled[req_id] -= len(drafts)
        self.step_drafts = {}
        return token_budget + num_drafts

    def verified(self, num_drafts: int, num_emitted: int) -> None:
        """A request's drafts came back with `num_emitted` tokens (accepted + one)."""
        self.stats.observe(num_drafts, num_emitted - 1)
        self.policy.observe_drafts(num_drafts, num_emitted - 1)

    def take_stats(self) -> SpecDecodingStats:
        stats, self.stats = self.stats, SpecDecodingStats(self.stats.num_spec_tokens)
        return stats


@dataclass
class SpecDecodingStats:
    """Drafts since the previous snapshot (vLLM's names; Prometheus counters)."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if len(self.num_accepted_tokens_per_pos) < self.num_spec_tokens:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1
