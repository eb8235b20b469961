"""Paged-attention metadata: what every attention layer of one step reads.

Layout for a batch of 2 requests, page_size 4 (S = max_num_seqs):

    tokens      [a5 a6 a7 | b0 b1 b2 | pad pad]   num_tokens T = 8 (bucketed)
    cu_q_lens   [0, 3, 6, 6, ...]                 int32[S + 1]
    kv_lens     [8, 3, 0, ...]                    int32[S] (context incl. this step)
    page_indices[[7, 2, 0..], [5, 0, ..], ...]    int32[S, pages_per_seq]
    slot_mapping[2*4+1, 2*4+2, 2*4+3, 20, 21, 22, 0, 0]   page * page_size + offset;
                                                  padding writes into the null page 0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StateMetadata:
    """What a linear-attention layer of one step reads (kernels_pallas/gated_delta_rule's
    ragged contract): per sequence, the state slot it starts from, the slot it leaves its
    state in (another one when the prefix cache keeps the state it started from), and whether
    it has a state yet (False for a prompt's first step: it starts from zeros)."""

    read_slots: jax.Array  # int32[S]
    write_slots: jax.Array  # int32[S]
    has_initial_state: jax.Array  # bool[S]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array  # int32[T]
    kv_lens: jax.Array  # int32[S]
    page_indices: jax.Array  # int32[S, pages_per_seq]
    cu_q_lens: jax.Array  # int32[S + 1]
    num_seqs: jax.Array  # int32[1]
    # The attention variant's work plan for this step (kernels_pallas.attention_plan), built
    # once before the layers and shared by all of them; None for variants without one.
    plan: Any = None
    state: StateMetadata | None = None  # a model with linear-attention layers only
