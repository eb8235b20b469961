"""The persistent input batch: host-side state of every request the worker holds.

Requests keep one row ("slot") for as long as they stay in the batch, so a step
only sends diffs: new page ids and token counts. Per step, `prepare()` turns the
scheduled rows into the flat padded arrays of one forward pass (pure NumPy).

    token_ids   [max_num_seqs, max_model_len]   known tokens (prompt, and outputs
                                                 known at admission after a preemption)
    block_table [groups, max_num_seqs, max_pages]  page ids of each KV cache group's table,
                                                 appended as the scheduler grows them

A token whose position is at or past `num_known_tokens` is the one sampled by
the previous step: it has not reached the host yet (async scheduling), so the
device reads it from its own `last_sampled[slot]`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import jax
import numpy as np

from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.packing import Packing

# NumPy on the host (InputBatch.prepare), jax.Array inside the forward (unpacked there).
ArrayT = TypeVar("ArrayT", np.ndarray, jax.Array)


@jax.tree_util.register_dataclass
@dataclass
class StepInputs(Generic[ArrayT]):
    """One step's forward inputs (shapes padded; see model_runner for their use).

    Request rows Q = min(T, max_num_seqs): a step cannot hold more requests than tokens, so
    a decode of a few sequences carries a few page-table rows, not max_num_seqs of them.
    """

    input_ids: ArrayT  # i32[T]
    prev_slot: ArrayT  # i32[T]; >= 0: take last_sampled[prev_slot] instead
    positions: ArrayT  # i32[T]
    slot_mapping: ArrayT  # i32[G, T]: each KV cache group's slots
    kv_lens: ArrayT  # i32[Q]
    page_indices: ArrayT  # i32[G, Q, max_pages]
    cu_q_lens: ArrayT  # i32[Q + 1]
    num_seqs: ArrayT  # i32[1]
    # i32[min(T, max_logit_rows)]: the last token of each scheduled request (a request
    # with k draft tokens: its last k + 1 tokens, one row per draft then one more).
    logits_indices: ArrayT

    @staticmethod
    @functools.cache
    def packing(num_tokens: int, max_num_seqs: int, max_pages: int,
                max_logit_rows: int, num_groups: int = 1) -> Packing:
        """The packed layout of a `num_tokens` bucket (one upload per step)."""
        T, Q, L = num_tokens, min(num_tokens, max_num_seqs), min(num_tokens, max_logit_rows)
        G = num_groups
        return Packing((
            ("input_ids", (T,), "i32"), ("prev_slot", (T,), "i32"),
            ("positions", (T,), "i32"), ("slot_mapping", (G, T), "i32"),
            ("kv_lens", (Q,), "i32"), ("page_indices", (G, Q, max_pages), "i32"),
            ("cu_q_lens", (Q + 1,), "i32"), ("num_seqs", (1,), "i32"),
            ("logits_indices", (L,), "i32"),
        ))


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, vocab_size: int,
                 max_logit_rows: int | None = None, num_groups: int = 1) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_logit_rows = max_logit_rows or max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_pages = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), np.int32)
        self.num_groups = num_groups
        self.block_table = np.zeros((num_groups, max_num_seqs, self.max_pages), np.int32)
        self.num_blocks = np.zeros((num_groups, max_num_seqs), np.int32)
        self.num_known_tokens = np.zeros(max_num_seqs, np.int32)
        self.num_computed_tokens = np.zeros(max_num_seqs, np.int32)
        # Sampling parameters per slot.
        self.temperature = np.ones(max_num_seqs, np.float32)
        self.top_k = np.zeros(max_num_seqs, np.int32)
        self.top_p = np.ones(max_num_seqs, np.float32)
        self.min_p = np.zeros(max_num_seqs, np.float32)
        self.repetition_penalty = np.ones(max_num_seqs, np.float32)
        self.frequency_penalty = np.zeros(max_num_seqs, np.float32)
        self.presence_penalty = np.zeros(max_num_seqs, np.float32)
        self.seeds = np.zeros(max_num_seqs, np.uint32)
        self.num_logprobs = np.full(max_num_seqs, -1, np.int32)
        # Sequence positions before which EOS / stop_token_ids are masked (min_tokens).
        self.min_tokens_end = np.zeros(max_num_seqs, np.int32)
        # A logit_bias, allowed_token_ids or bad_words: the sampler's processors run (sampler.py).
        self.has_processors = np.zeros(max_num_seqs, bool)
        self.num_prompt_tokens = np.zeros(max_num_seqs, np.int32)
        self.prompt_logprobs = np.full(max_num_seqs, -1, np.int32)  # -1: not asked
        self.vocab_size = vocab_size
        self.req_id_to_slot: dict[str, int] = {}
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))

    def add_request(
        self,
        req_id: str,
        token_ids: list[int],
        params: SamplingParams,
        block_ids: tuple[list[int], ...],
        num_computed_tokens: int,
        seed: int,
        num_prompt_tokens: int | None = None,
    ) -> int:
        """Place a new (or resumed) request in a free slot; returns the slot.
        `token_ids` holds its prompt (`num_prompt_tokens`, default all) then any outputs."""
        slot = self._free_slots.pop()
        self.req_id_to_slot[req_id] = slot
        n = len(token_ids)
        self.token_ids[slot, :n] = token_ids
        self.num_known_tokens[slot] = n
        self.num_computed_tokens[slot] = num_computed_tokens
        self.num_blocks[:, slot] = 0
        self.append_blocks(slot, block_ids)
        self.temperature[slot] = params.temperature
        self.top_k[slot] = min(max(params.top_k, 0), self.vocab_size)  # more than V: all
        self.top_p[slot] = params.top_p
        self.min_p[slot] = params.min_p
        self.repetition_penalty[slot] = params.repetition_penalty
        self.frequency_penalty[slot] = params.frequency_penalty
        self.presence_penalty[slot] = params.presence_penalty
        self.seeds[slot] = seed & 0xFFFFFFFF
        self.num_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_tokens[slot] = n if num_prompt_tokens is None else num_prompt_tokens
        self.min_tokens_end[slot] = self.num_prompt_tokens[slot] + params.min_tokens
        self.has_processors[slot] = bool(params.logit_bias or params.allowed_token_ids is not None
                                         or params.bad_words_token_ids)
        self.prompt_logprobs[slot] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        return slot

    def append_blocks(self, slot: int, block_ids: tuple[list[int], ...]) -> None:
        """Extend each group's table of `slot` by its new pages."""
        for g, ids in enumerate(block_ids):
            if ids:
                n, k = int(self.num_blocks[g, slot]), len(ids)
                self.block_table[g, slot, n : n + k] = ids
                self.num_blocks[g, slot] = n + k

    def record_sampled(self, req_ids: list[str], slots: np.ndarray, first_pos: np.ndarray,
                       sampled: list[list[int]]) -> None:
        """Keep a finished step's sampled tokens (those of request i start at position
        first_pos[i]) so later steps feed them from the host: a step whose tokens are all
        known does not wait for the previous step's sampler (pipeline microbatches)."""
        L = self.max_model_len
        for req_id, slot, pos, toks in zip(req_ids, slots.tolist(), first_pos.tolist(), sampled):
            # Only the request still in that slot, and only right after its known tokens.
            if toks and self.req_id_to_slot.get(req_id) == slot and self.num_known_tokens[slot] == pos:
                end = min(pos + len(toks), L)
                self.token_ids[slot, pos:end] = toks[: end - pos]
                self.num_known_tokens[slot] = end

    def remove_request(self, req_id: str) -> None:
        slot = self.req_id_to_slot.pop(req_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def prepare(
        self, req_ids: list[str], num_scheduled: np.ndarray, padded_tokens: int,
        num_drafts: np.ndarray | None = None, draft_ids: list[int] | None = None,
    ) -> tuple[StepInputs[np.ndarray], np.ndarray, np.ndarray]:
        """Host inputs for the scheduled requests (in `req_ids` order), padded to
        `padded_tokens` tokens and min(padded_tokens, max_num_seqs) request rows.
        `num_drafts[i]` draft tokens (`draft_ids`, flat) follow request i's first token.

        Returns the inputs, the slot of each request and whether each request
        samples a real token this step (False for a prefill chunk short of the
        end of its known tokens).
        """
        bs = self.block_size
        R = len(req_ids)
        Q = min(padded_tokens, self.max_num_seqs)
        slots = np.fromiter((self.req_id_to_slot[r] for r in req_ids), np.int32, R)
        computed = self.num_computed_tokens[slots]
        T = int(num_scheduled.sum())
        cu = np.zeros(Q + 1, np.int32)
        np.cumsum(num_scheduled, out=cu[1 : R + 1])
        cu[R + 1 :] = T
        row = np.repeat(np.arange(R, dtype=np.int32), num_scheduled)
        pos = computed[row] + (np.arange(T, dtype=np.int32) - cu[row])
        tok_slot = slots[row]

        inp = StepInputs(
            input_ids=np.zeros(padded_tokens, np.int32),
            prev_slot=np.full(padded_tokens, -1, np.int32),
            positions=np.zeros(padded_tokens, np.int32),
            slot_mapping=np.zeros((self.num_groups, padded_tokens), np.int32),  # padding: page 0
            kv_lens=np.zeros(Q, np.int32),
            page_indices=np.zeros((self.num_groups, Q, self.max_pages), np.int32),
            cu_q_lens=cu,
            num_seqs=np.array([R], np.int32),
            logits_indices=np.zeros(min(padded_tokens, self.max_logit_rows), np.int32),
        )
        known = self.num_known_tokens[tok_slot]
        from_host = pos < known
        inp.input_ids[:T] = np.where(from_host, self.token_ids[tok_slot, np.minimum(pos, self.max_model_len - 1)], 0)
        inp.prev_slot[:T] = np.where(from_host, -1, tok_slot)
        inp.positions[:T] = pos
        inp.slot_mapping[:, :T] = self.block_table[:, tok_slot, pos // bs] * bs + pos % bs
        end = computed + num_scheduled
        inp.kv_lens[:R] = end
        inp.page_indices[:, :R] = self.block_table[:, slots]
        if num_drafts is None:
            inp.logits_indices[:R] = cu[1 : R + 1] - 1
        else:
            per_req = num_drafts + 1
            group = np.repeat(np.arange(R), per_req)
            within = np.arange(len(group)) - np.repeat(np.cumsum(per_req) - per_req, per_req)
            rows = cu[1 : R + 1][group] - per_req[group] + within
            inp.logits_indices[: len(rows)] = rows
            drafts_at = rows[within > 0]  # every row after a request's first holds a draft
            inp.input_ids[drafts_at] = draft_ids
            inp.prev_slot[drafts_at] = -1
        self.num_computed_tokens[slots] = end
        samples = end >= self.num_known_tokens[slots]
        return inp, slots, samples


def as_dict(inp: StepInputs[np.ndarray]) -> dict[str, np.ndarray]:
    """Field name -> array (for `Packing.pack`)."""
    return {f.name: getattr(inp, f.name) for f in fields(inp)}
