"""Run the decoder over whole prompts (one sequence each, prefill only) for model tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import AttentionMetadata, LlamaForCausalLM
from jaxserve.models.variables import model_variables


def prompt_logits(model: LlamaForCausalLM, params, token_ids: list[int], page_size: int = 16) -> np.ndarray:
    """float32 logits [len(token_ids), vocab] of every position of one prompt."""
    T = len(token_ids)
    n = (T + page_size - 1) // page_size
    G = len(model.opts.kv_cache_groups.groups)  # each KV cache group its own pages
    spec = model.kv_cache(G * n + 1, page_size)  # + the null page 0
    cache = jnp.zeros(spec.shape, spec.dtype)
    pages = np.arange(1, G * n + 1, dtype=np.int32).reshape(G, n)
    slots = pages[:, np.arange(T) // page_size] * page_size + np.arange(T) % page_size
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32),
        kv_lens=jnp.asarray([T], jnp.int32),
        page_indices=jnp.asarray(pages[:, None, :], jnp.int32),
        cu_q_lens=jnp.asarray([0, T], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
    )

    @jax.jit
    def run(params, ids, pos, cache, md):
        params = model_variables(params)
        h, _ = model.apply(params, ids, pos, cache, md)
        return model.apply(params, h, method=LlamaForCausalLM.compute_logits)

    ids = jnp.asarray(token_ids, jnp.int32)
    return np.asarray(run(params, ids, jnp.arange(T, dtype=jnp.int32), cache, md))
