"""The sampler's per-row inputs, built on the host from the input batch (vLLM's sampling
metadata): one packed int32 buffer per step, R (padded) rows.

A plain step has one row per request. A verification step (speculative decoding) has
1 + k rows for a request with k drafts: row j samples the token at position
kv_len - k + j and verifies draft j (none on the last row).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from jaxserve.worker.input_batch import InputBatch, StepInputs
from jaxserve.worker.packing import Packing
from jaxserve.worker.sampler import SamplerMode, needs_processors


class SamplerInputs(NamedTuple):
    """One step's sampler inputs: the packed rows and the program variant they need."""

    packed: np.ndarray
    mode: SamplerMode
    processors: bool  # some row has a penalty or logits processor (sampler.needs_processors)


@functools.cache
def sampler_packing(num_rows: int, verify: bool = False) -> Packing:
    """The packed layout of R rows (with `verify`, the rejection sampler's two more)."""
    R = (num_rows,)
    # verify: each row's draft (-1: none) and the index of its request's first row.
    drafts = (("draft_ids", R, "i32"), ("group_first", R, "i32")) if verify else ()
    return Packing((*drafts,
        ("slots", R, "i32"), ("real", R, "bool"), ("temperature", R, "f32"),
        ("top_k", R, "i32"), ("top_p", R, "f32"), ("min_p", R, "f32"),
        ("repetition_penalty", R, "f32"), ("frequency_penalty", R, "f32"),
        ("presence_penalty", R, "f32"), ("seeds", R, "u32"), ("positions", R, "i32"),
        ("min_tokens_end", R, "i32"), ("logprobs", R, "bool"),
    ))


def sampling_inputs(b: InputBatch, slots: np.ndarray, samples: np.ndarray,
                    positions: np.ndarray, R: int,
                    verify: dict[str, np.ndarray] | None = None) -> SamplerInputs:
    """Packed per-row inputs for R (padded) rows, the batch's mode and whether any row needs
    the logits processors. Row i reads slot slots[i]; `positions`: the index in its sequence
    of each row's sampled token."""
    n, S = len(slots), b.max_num_seqs

    def rows(a: np.ndarray, fill: float) -> np.ndarray:
        out = np.full(R, fill, a.dtype)
        out[:n] = a[slots]
        return out

    values = {
        "slots": np.concatenate([slots, np.full(R - n, S, np.int32)]),  # S: dropped
        "real": np.concatenate([samples, np.zeros(R - n, bool)]),
        "temperature": rows(b.temperature, 0.0), "top_k": rows(b.top_k, 0),
        "top_p": rows(b.top_p, 1.0), "min_p": rows(b.min_p, 0.0),
        "repetition_penalty": rows(b.repetition_penalty, 1.0),
        "frequency_penalty": rows(b.frequency_penalty, 0.0),
        "presence_penalty": rows(b.presence_penalty, 0.0),
        "seeds": rows(b.seeds, 0),
        "positions": np.concatenate([positions, np.zeros(R - n, np.int32)]),
        "min_tokens_end": rows(b.min_tokens_end, 0),
        "logprobs": rows(b.num_logprobs >= 0, False),
        **(verify or {}),
    }
    mode = SamplerMode.for_batch(b.temperature[slots], b.top_k[slots], b.top_p[slots],
                                 b.min_p[slots])
    processors = needs_processors(
        b.repetition_penalty[slots], b.frequency_penalty[slots], b.presence_penalty[slots],
        b.min_tokens_end[slots], positions, b.has_processors[slots])
    return SamplerInputs(sampler_packing(R, verify is not None).pack(values), mode, processors)


def verify_inputs(b: InputBatch, inp: StepInputs, slots: np.ndarray, samples: np.ndarray,
                  num_drafts: np.ndarray, drafts: list[int], R: int) -> SamplerInputs:
    """The rejection sampler's packed inputs: request i's 1 + num_drafts[i] rows."""
    n = len(slots)
    per_req = num_drafts + 1
    group = np.repeat(np.arange(n), per_req)
    first = np.cumsum(per_req) - per_req
    within = np.arange(len(group)) - first[group]
    positions = inp.kv_lens[group] - num_drafts[group] + within
    draft_ids = np.full(R, -1, np.int32)
    last = within == num_drafts[group]
    draft_ids[np.flatnonzero(~last)] = drafts
    group_first = np.arange(R, dtype=np.int32)  # padding rows: a group of their own
    group_first[: len(group)] = first[group]
    return sampling_inputs(b, slots[group], samples[group], positions, R,
                           {"draft_ids": draft_ids, "group_first": group_first})


def grammar_bitmask(masks: dict[str, np.ndarray] | None, req_ids: list[str], per_req: np.ndarray | None,
                    num_rows: int, vocab_size: int) -> np.ndarray | None:
    """The step's allowed-token words per sampled row, from the engine core's per-request
    grammar masks (None without any: the sampler then runs without a mask argument)."""
    if not masks:
        return None
    words = -(-vocab_size // 32)
    bitmask = np.full((num_rows, words), -1, np.int32)  # rows without a grammar: all allowed
    n = len(req_ids)
    first_rows = np.arange(n) if per_req is None else np.cumsum(per_req) - per_req
    for i, r in zip(first_rows.tolist(), req_ids):
        if r in masks:  # (a request with a grammar has no drafts)
            bitmask[i] = masks[r][:words]
    return bitmask
