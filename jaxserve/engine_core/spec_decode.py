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

import numpy as np

from jaxserve.config import SpeculativeConfig
from jaxserve.sampling_params import SamplingParams


class NgramProposer:
    """Prompt-lookup drafts from a request's own tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min or 1
        self.max_n = config.prompt_lookup_max or self.min_n

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
    token) and structured outputs (the grammar must advance over each draft)."""
    return (
        params.structured_outputs is None
        and params.logprobs is None
        and params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
    )


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
