"""The sampler's per-slot state on device (penalties, min_tokens' stop ids, logit biases),
set when a request takes its slot and updated by every sampling step."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling_params import MAX_LOGIT_BIAS


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyState:
    prompt_mask: jax.Array  # bool[S, V]
    output_counts: jax.Array  # i32[S, V]
    stop_mask: jax.Array  # bool[S, V]: EOS and stop_token_ids, masked before min_tokens
    bias_ids: jax.Array  # i32[S, MAX_LOGIT_BIAS]; V = unused entry
    bias_values: jax.Array  # f32[S, MAX_LOGIT_BIAS]

    @classmethod
    def zeros(cls, num_slots: int, vocab_size: int) -> PenaltyState:
        """Host arrays (NumPy) of an empty state, to be placed on the mesh."""
        S, V = num_slots, vocab_size
        return cls(np.zeros((S, V), bool), np.zeros((S, V), np.int32), np.zeros((S, V), bool),
                   np.full((S, MAX_LOGIT_BIAS), V, np.int32),
                   np.zeros((S, MAX_LOGIT_BIAS), np.float32))


def admit(penalties: PenaltyState, slot, prompt_ids, output_ids, stop_ids, bias_ids,
          bias_values) -> PenaltyState:
    """Reset a slot's rows: penalties from its prompt (and outputs, when resumed), the ids
    min_tokens masks, its logit biases. Id arrays are padded with `vocab_size`, which
    `mode="drop"` discards."""
    V = penalties.prompt_mask.shape[1]
    mask = jnp.zeros((V,), bool).at[prompt_ids].set(True, mode="drop")
    counts = jnp.zeros((V,), jnp.int32).at[output_ids].add(1, mode="drop")
    stop = jnp.zeros((V,), bool).at[stop_ids].set(True, mode="drop")
    return PenaltyState(
        penalties.prompt_mask.at[slot].set(mask),
        penalties.output_counts.at[slot].set(counts),
        penalties.stop_mask.at[slot].set(stop),
        penalties.bias_ids.at[slot].set(bias_ids),
        penalties.bias_values.at[slot].set(bias_values),
    )


def admit_inputs(max_model_len: int, vocab_size: int, prompt: list[int], outputs: list[int],
                 stop_ids: Collection[int] = (),
                 logit_bias: tuple[tuple[int, float], ...] = ()) -> tuple[np.ndarray, ...]:
    """`admit`'s id and bias arrays, padded to fixed shapes (one compiled program)."""
    L, V = max_model_len, vocab_size
    prompt_ids = np.full(L, V, np.int32)
    prompt_ids[: len(prompt)] = prompt
    output_ids = np.full(L, V, np.int32)
    output_ids[: len(outputs)] = outputs
    stop = np.fromiter((t for t in stop_ids if t < V), np.int32)
    stop_arr = np.full(L, V, np.int32)
    stop_arr[: min(len(stop), L)] = stop[:L]
    bias_ids = np.full(MAX_LOGIT_BIAS, V, np.int32)
    bias_values = np.zeros(MAX_LOGIT_BIAS, np.float32)
    for i, (tok, b) in enumerate(logit_bias):
        bias_ids[i], bias_values[i] = min(tok, V), b  # ids >= V: dropped on device
    return prompt_ids, output_ids, stop_arr, bias_ids, bias_values
