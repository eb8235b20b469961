"""The Gated DeltaNet layer's state math in plain `jax.numpy`: the oracle the device kernels are
tested against, and the CPU path until one is faster.

Per value head h, with q and k L2-normalized (q also scaled by dk ** -0.5), a token updates
the state S (dk x dv) and reads it:

    S   <- exp(g_t) * S                        g_t <= 0: the gate's decay, in log space
    S   <- S + beta_t * k_t (v_t - S^T k_t)^T   the delta rule: write v_t where k_t points
    o_t  = S^T q_t

Query/key head j serves value heads j * r .. j * r + r - 1 (r = num_v_heads / num_k_heads, as
transformers' `repeat_interleave`).

Prefill takes the chunked form (chunks of C = 64 tokens, the reference kernels'): within a
chunk, with G the gate's running sum and D[t, s] = exp(G_t - G_s) for s <= t, the writes
u = (I + strictly_lower(diag(beta) K K^T * D))^-1 diag(beta) (V - exp(G) * K S0), then

    O    = exp(G) * Q S0 + lower(Q K^T * D) u
    S_C  = exp(G_C) S0 + (K * exp(G_C - G))^T u

which is the recurrence above, exactly, with matrix products in place of C steps.

Ragged batches (`ragged_*`; the delta rule token by token, for decode, or chunked, for
prefill) follow ragged paged attention's contract: sequences side by side,
delimited by `cu_q_lens`, the first `num_seqs` real; sequence s reads its states from slot
`state_slots[s]`, starting from zeros unless `has_initial_state[s]` (its earlier tokens were
computed: a later chunk of its prompt, or a decode), and writes them back to the same slot.
With `store=False` they return each sequence's new states instead ([rows, ...], in
`state_slots`' order), for a caller that writes them elsewhere (the decoder: into another slot
when the prefix cache keeps the state a step started from, and every layer's slots in one
donated array, written in place).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK_SIZE = 64
L2_NORM_EPS = 1e-6


def l2_normalize(x: jax.Array) -> jax.Array:
    """transformers' (and the FLA kernels') l2norm: x / sqrt(sum(x^2) + eps), in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_NORM_EPS)


def _prepare_qk(q: jax.Array, k: jax.Array, num_v_heads: int) -> tuple[jax.Array, jax.Array]:
    """Normalized q (scaled) and k, one per value head: [T, num_v_heads, dk] float32."""
    r = num_v_heads // q.shape[1]
    q = jnp.repeat(l2_normalize(q), r, axis=1) * q.shape[-1] ** -0.5
    return q, jnp.repeat(l2_normalize(k), r, axis=1)


def _step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
          beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of every head: state [H, dk, dv]; q, k [H, dk]; v [H, dv]; g, beta [H]."""
    state = state * jnp.exp(g)[:, None, None]
    delta = (v - jnp.einsum("hkv,hk->hv", state, k)) * beta[:, None]
    state = state + k[:, :, None] * delta[:, None, :]
    return state, jnp.einsum("hkv,hk->hv", state, q)


def gated_delta_rule_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                               beta: jax.Array, state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One sequence, token by token (decode). q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta
    [T, Hv]; state [Hv, dk, dv]. Returns (o [T, Hv, dv] float32, the state after)."""
    q, k = _prepare_qk(q, k, v.shape[1])
    f32 = jnp.float32

    def body(s: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        return _step(s, *x)

    state, o = jax.lax.scan(body, state.astype(f32),
                            (q, k, v.astype(f32), g.astype(f32), beta.astype(f32)))
    return o, state


def gated_delta_rule_chunked(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                             beta: jax.Array, state: jax.Array, chunk_size: int = CHUNK_SIZE
                             ) -> tuple[jax.Array, jax.Array]:
    """One sequence in chunks of `chunk_size` tokens (prefill); the recurrent form's
    signature and results. Padding past the last token has beta = 0 and g = 0: it writes
    nothing and does not decay the state."""
    f32 = jnp.float32
    num_tokens, num_heads = v.shape[:2]
    q, k = _prepare_qk(q, k, num_heads)
    pad = (-num_tokens) % chunk_size
    n = (num_tokens + pad) // chunk_size

    def chunks(x: jax.Array) -> jax.Array:  # [T, H, ...] -> [n, H, C, ...]
        x = jnp.pad(x.astype(f32), [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return jnp.swapaxes(x.reshape(n, chunk_size, *x.shape[1:]), 1, 2)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    big_g = jnp.cumsum(g, axis=-1)  # [n, H, C]
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    # D[t, s] = exp(G_t - G_s) for s <= t (at most 1: no overflow), 0 above the diagonal.
    decay = jnp.exp(jnp.where(causal, big_g[..., :, None] - big_g[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    strict = jnp.tril(k_beta @ jnp.swapaxes(k, -1, -2) * decay, -1)
    eye = jnp.eye(chunk_size, dtype=f32)
    # (I + strict)^-1 applied to [V_beta | K_beta * exp(G)] by one unit-lower solve.
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(big_g)[..., None]], axis=-1)
    solved = jax.scipy.linalg.solve_triangular(eye + strict, rhs, lower=True, unit_diagonal=True)
    u_base, w = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]
    intra = q @ jnp.swapaxes(k, -1, -2) * decay  # [n, H, C, C], lower incl. the diagonal
    q_decayed = q * jnp.exp(big_g)[..., None]
    k_to_end = k * jnp.exp(big_g[..., -1:] - big_g)[..., None]

    def body(s: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        u_b, w_i, intra_i, q_d, k_e, g_end = x
        u = u_b - w_i @ s
        o = q_d @ s + intra_i @ u
        s = s * jnp.exp(g_end)[:, None, None] + jnp.swapaxes(k_e, -1, -2) @ u
        return s, o

    state, o = jax.lax.scan(body, state.astype(f32),
                            (u_base, w, intra, q_decayed, k_to_end, big_g[..., -1]))
    o = jnp.swapaxes(o, 1, 2).reshape(n * chunk_size, num_heads, -1)
    return o[:num_tokens], state


def causal_conv1d(x: jax.Array, weight: jax.Array, conv_state: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """One sequence's causal depthwise convolution with SiLU: x [T, C]; weight [K, C] (tap K-1
    on the current token); conv_state [K-1, C], the K-1 inputs before x. Returns (y [T, C],
    the K-1 inputs that end x)."""
    width = weight.shape[0]
    full = jnp.concatenate([conv_state.astype(x.dtype), x], axis=0)
    num_tokens = x.shape[0]
    y = sum(full[j:j + num_tokens].astype(jnp.float32) * weight[j].astype(jnp.float32)
            for j in range(width))
    return jax.nn.silu(y).astype(x.dtype), full[num_tokens:]


def rms_norm_gated(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """The output norm (transformers' Qwen3NextRMSNormGated): RMS-normalize x over its last
    axis in float32, scale by `weight` in x's dtype, then multiply by SiLU(gate)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = weight * xf.astype(x.dtype)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


# --- ragged batches ------------------------------------------------------------------------


def _token_sequences(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int
                     ) -> tuple[jax.Array, jax.Array]:
    """Each token's sequence and whether it is real (not padding)."""
    t = jnp.arange(num_tokens)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right")
    return jnp.minimum(seq, cu_q_lens.shape[0] - 2), t < cu_q_lens[num_seqs]


def _initial(states: jax.Array, state_slots: jax.Array, has_initial_state: jax.Array
             ) -> jax.Array:
    """Each sequence's starting state: its slot's, or zeros."""
    start = states[state_slots]
    keep = has_initial_state.reshape((-1,) + (1,) * (start.ndim - 1))
    return jnp.where(keep, start, jnp.zeros_like(start))


def _store(states: jax.Array, state_slots: jax.Array, num_seqs: jax.Array, new: jax.Array
           ) -> jax.Array:
    """Write the real sequences' states back to their slots (padding rows write nothing,
    whatever slot they name)."""
    real = jnp.arange(state_slots.shape[0]) < num_seqs
    slots = jnp.where(real, state_slots, states.shape[0])  # out of bounds: dropped
    return states.at[slots].set(new.astype(states.dtype), mode="drop")


def ragged_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                            beta: jax.Array, states: jax.Array, state_slots: jax.Array,
                            cu_q_lens: jax.Array, num_seqs: jax.Array,
                            has_initial_state: jax.Array, store: bool = True) -> tuple[jax.Array, jax.Array]:
    """A mixed batch, token by token: q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv];
    states [num_slots, Hv, dk, dv]; state_slots, has_initial_state [max_num_seqs];
    cu_q_lens [max_num_seqs + 1]; num_seqs a scalar. Returns (o [T, Hv, dv] float32, zeros
    on padding rows; states with each real sequence's slot advanced)."""
    num_tokens = q.shape[0]
    q, k = _prepare_qk(q, k, v.shape[1])
    seq, real = _token_sequences(cu_q_lens, num_seqs, num_tokens)
    f32 = jnp.float32
    carry = _initial(states, state_slots, has_initial_state).astype(f32)

    def body(c: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        s, is_real, *token = x
        old = c[s]
        new, o = _step(old, *token)
        # Only the token's own sequence is touched (a padding token writes its old state
        # back): a step costs one state, not the batch's.
        return c.at[s].set(jnp.where(is_real, new, old)), jnp.where(is_real, o, 0.0)

    carry, o = jax.lax.scan(body, carry, (seq, real, q, k, v.astype(f32), g.astype(f32),
                                          beta.astype(f32)))
    if not store:
        return o, carry
    return o, _store(states, state_slots, num_seqs, carry)


def _one_chunk(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
               state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One chunk of one sequence in the chunked form (the module docstring's formulas): q, k
    [C, H, dk] prepared (`_prepare_qk`), v [C, H, dv], g, beta [C, H], state [H, dk, dv], all
    float32. Rows with beta = g = 0 write nothing and do not decay the state."""
    size = q.shape[0]
    q, k, v = (jnp.swapaxes(x, 0, 1) for x in (q, k, v))  # [H, C, d]
    g, beta = g.T, beta.T  # [H, C]
    big_g = jnp.cumsum(g, axis=-1)
    causal = jnp.tril(jnp.ones((size, size), bool))
    decay = jnp.exp(jnp.where(causal, big_g[..., :, None] - big_g[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    strict = jnp.tril(k_beta @ jnp.swapaxes(k, -1, -2) * decay, -1)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(big_g)[..., None]], axis=-1)
    solved = jax.scipy.linalg.solve_triangular(jnp.eye(size, dtype=q.dtype) + strict, rhs,
                                               lower=True, unit_diagonal=True)
    u = solved[..., :v.shape[-1]] - solved[..., v.shape[-1]:] @ state
    o = (q * jnp.exp(big_g)[..., None]) @ state + (q @ jnp.swapaxes(k, -1, -2) * decay) @ u
    k_to_end = k * jnp.exp(big_g[..., -1:] - big_g)[..., None]
    state = state * jnp.exp(big_g[..., -1])[:, None, None] + jnp.swapaxes(k_to_end, -1, -2) @ u
    return jnp.swapaxes(o, 0, 1), state


def ragged_gated_delta_rule_chunked(
        q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
        states: jax.Array, state_slots: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
        has_initial_state: jax.Array, store: bool = True, chunk_size: int = CHUNK_SIZE) -> tuple[jax.Array, jax.Array]:
    """`ragged_gated_delta_rule` in the chunked form: each sequence's tokens in chunks of
    `chunk_size` (its last one short), the chunks of every sequence one after another, so a
    prefill step loops over about T / chunk_size + sequences chunks, not T tokens. Same
    signature and results."""
    f32, size = jnp.float32, chunk_size
    num_tokens, num_rows = q.shape[0], state_slots.shape[0]
    q, k = _prepare_qk(q, k, v.shape[1])
    # Padded by a chunk, so every chunk's slice is in bounds; pad rows have g = beta = 0.
    qp, kp, vp, gp, bp = (jnp.pad(x.astype(f32), [(0, size)] + [(0, 0)] * (x.ndim - 1))
                          for x in (q, k, v, g, beta))
    real = jnp.arange(num_rows) < num_seqs
    lens = jnp.where(real, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    per_seq = -(-lens // size)  # chunks of each sequence
    ends = jnp.cumsum(per_seq)
    chunk = jnp.arange(num_tokens // size + num_rows)  # at most this many chunks
    seq = jnp.minimum(jnp.searchsorted(ends, chunk, side="right"), num_rows - 1)
    valid = chunk < ends[-1]
    within = chunk - (ends - per_seq)[seq]
    start = jnp.where(valid, cu_q_lens[seq] + within * size, num_tokens)
    length = jnp.where(valid, jnp.minimum(size, cu_q_lens[seq + 1] - start), 0)
    first, last = within == 0, valid & (within == per_seq[seq] - 1)
    initial = _initial(states, state_slots, has_initial_state).astype(f32)

    def body(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        state, finals, out = carry
        s, at, n, is_first, is_last = seq[j], start[j], length[j], first[j], last[j]
        state = jnp.where(is_first, initial[s], state)
        mask = (jnp.arange(size) < n)[:, None]

        def rows(a: jax.Array) -> jax.Array:
            return jax.lax.dynamic_slice_in_dim(a, at, size, 0)

        o, state = _one_chunk(rows(qp), rows(kp), rows(vp), jnp.where(mask, rows(gp), 0.0),
                              jnp.where(mask, rows(bp), 0.0), state)
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mask[..., None], o, rows(out)),
                                                  at, 0)
        finals = finals.at[s].set(jnp.where(is_last, state, finals[s]))
        return state, finals, out

    out = jnp.zeros((num_tokens + size, *vp.shape[1:]), f32)
    # Only the step's chunks run (a loop of dynamic length, not the static bound's).
    _, finals, out = jax.lax.fori_loop(0, ends[-1], body, (initial[0], initial, out))
    if not store:
        return out[:num_tokens], finals
    return out[:num_tokens], _store(states, state_slots, num_seqs, finals)


def ragged_causal_conv1d(x: jax.Array, weight: jax.Array, conv_states: jax.Array,
                         state_slots: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array,
                         has_initial_state: jax.Array, store: bool = True) -> tuple[jax.Array, jax.Array]:
    """`causal_conv1d` over a mixed batch: x [T, C]; conv_states [num_slots, K-1, C]. Returns
    (y [T, C], zeros on padding rows; conv_states with each real sequence's slot holding the
    K-1 inputs that end it)."""
    num_tokens, width = x.shape[0], weight.shape[0]
    seq, real = _token_sequences(cu_q_lens, num_seqs, num_tokens)
    start = _initial(conv_states, state_slots, has_initial_state).astype(x.dtype)
    pos = jnp.arange(num_tokens) - cu_q_lens[seq]  # each token's index in its sequence

    def tap(offset: jax.Array | int) -> jax.Array:
        """The input `offset` (<= 0) tokens before each token: x itself, or the state."""
        i = pos + offset
        from_state = start[seq, jnp.clip(width - 1 + i, 0, width - 2)]
        return jnp.where((i >= 0)[:, None], x[jnp.clip(jnp.arange(num_tokens) + offset, 0)],
                         from_state)

    y = sum(tap(j - width + 1).astype(jnp.float32) * weight[j].astype(jnp.float32)
            for j in range(width))
    y = jnp.where(real[:, None], jax.nn.silu(y), 0.0).astype(x.dtype)
    # Each sequence's last K-1 inputs: index len - (K-1) + r of its own, or of its state.
    lens = cu_q_lens[1:] - cu_q_lens[:-1]
    idx = lens[:, None] - (width - 1) + jnp.arange(width - 1)[None, :]  # [S, K-1]
    from_x = x[jnp.clip(cu_q_lens[:-1, None] + idx, 0, num_tokens - 1)]
    from_state = jnp.take_along_axis(start, jnp.clip(width - 1 + idx, 0, width - 2)[..., None],
                                     axis=1)
    last = jnp.where((idx >= 0)[..., None], from_x, from_state)
    if not store:
        return y, last
    return y, _store(conv_states, state_slots, num_seqs, last)
