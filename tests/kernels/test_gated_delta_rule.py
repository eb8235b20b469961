"""The Gated DeltaNet reference (kernels_pallas/gated_delta_rule/reference.py) against a float64
numpy oracle written from the recurrence, and against transformers' own Qwen3-Next functions:
chunk boundaries inside and across chunks, an initial state, GQA heads, a prompt split into
several steps carrying its states, and ragged batches beside one-sequence runs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gated_delta_rule import reference as gdn

HK, HV, DK, DV = 2, 4, 16, 8  # two value heads per query/key head
CONV_DIM, WIDTH = 12, 4


def oracle(q, k, v, g, beta, state):
    """The recurrence in float64, one token at a time."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    r = v.shape[1] // q.shape[1]
    q = np.repeat(q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6), r, 1) * q.shape[-1] ** -0.5
    k = np.repeat(k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6), r, 1)
    out = np.zeros(v.shape)
    s = s.copy()
    for t in range(q.shape[0]):
        for h in range(v.shape[1]):
            s[h] *= np.exp(g[t, h])
            s[h] += beta[t, h] * np.outer(k[t, h], v[t, h] - s[h].T @ k[t, h])
            out[t, h] = s[h].T @ q[t, h]
    return out, s


def conv_oracle(x, w, state):
    full = np.concatenate([np.asarray(state, np.float64), np.asarray(x, np.float64)])
    n, width = len(x), len(w)
    y = np.stack([(full[t:t + width] * np.asarray(w, np.float64)).sum(0) for t in range(n)])
    return y / (1 + np.exp(-y)), full[n:]


def inputs(rng, n):
    q = rng.standard_normal((n, HK, DK)).astype(np.float32)
    k = rng.standard_normal((n, HK, DK)).astype(np.float32)
    v = rng.standard_normal((n, HV, DV)).astype(np.float32)
    g = -rng.uniform(0.0, 1.5, (n, HV)).astype(np.float32)  # exp(g) in (0.22, 1]
    beta = rng.uniform(0.0, 1.0, (n, HV)).astype(np.float32)
    return q, k, v, g, beta


@pytest.mark.parametrize("n", [1, 64, 65, 150])
def test_recurrent_and_chunked_forms_equal_the_oracle(n: int) -> None:
    rng = np.random.default_rng(n)
    x = inputs(rng, n)
    state = rng.standard_normal((HV, DK, DV)).astype(np.float32) * 0.3
    want_o, want_s = oracle(*x, state)
    for form in (gdn.gated_delta_rule_recurrent, gdn.gated_delta_rule_chunked):
        o, s = jax.jit(form)(*x, state)
        np.testing.assert_allclose(o, want_o, rtol=2e-4, atol=2e-4, err_msg=form.__name__)
        np.testing.assert_allclose(s, want_s, rtol=2e-4, atol=2e-4, err_msg=form.__name__)


def test_chunked_form_with_small_chunks_and_a_strong_decay() -> None:
    """Chunks of 8 over 37 tokens, gates down to exp(-30) (exp(G) underflows in a chunk)."""
    rng = np.random.default_rng(7)
    q, k, v, g, beta = inputs(rng, 37)
    g = g * 20
    state = rng.standard_normal((HV, DK, DV)).astype(np.float32)
    want_o, want_s = oracle(q, k, v, g, beta, state)
    o, s = gdn.gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=8)
    np.testing.assert_allclose(o, want_o, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(s, want_s, rtol=2e-4, atol=2e-4)


def test_equal_to_transformers_qwen3_next_functions() -> None:
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    rng = np.random.default_rng(3)
    q, k, v, g, beta = inputs(rng, 100)
    state = rng.standard_normal((HV, DK, DV)).astype(np.float32) * 0.3
    t = lambda a: torch.from_numpy(a)[None]  # noqa: E731 - a batch of one
    for fn, ours in ((hf.torch_chunk_gated_delta_rule, gdn.gated_delta_rule_chunked),
                     (hf.torch_recurrent_gated_delta_rule, gdn.gated_delta_rule_recurrent)):
        want_o, want_s = fn(t(q), t(k), t(v), g=t(g), beta=t(beta), initial_state=t(state),
                            output_final_state=True, use_qk_l2norm_in_kernel=True)
        o, s = ours(q, k, v, g, beta, state)
        np.testing.assert_allclose(o, want_o[0].numpy(), rtol=5e-4, atol=5e-4)
        np.testing.assert_allclose(s, want_s[0].numpy(), rtol=5e-4, atol=5e-4)
    # The causal conv with its state, and the gated output norm.
    x = rng.standard_normal((9, CONV_DIM)).astype(np.float32)
    w = rng.standard_normal((WIDTH, CONV_DIM)).astype(np.float32)
    conv_state = rng.standard_normal((WIDTH - 1, CONV_DIM)).astype(np.float32)
    hf_state = torch.from_numpy(np.concatenate([np.zeros((1, CONV_DIM), np.float32), conv_state]).T[None].copy())
    want = hf.causal_conv1d_update(torch.from_numpy(x.T[None].copy()), hf_state,
                                   torch.from_numpy(w.T.copy()), None, "silu")
    y, new_state = gdn.causal_conv1d(x, w, conv_state)
    np.testing.assert_allclose(y, want[0].numpy().T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_state, hf_state[0].numpy().T[1:], rtol=1e-6)
    norm = hf.Qwen3NextRMSNormGated(DV, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, DV).astype(np.float32)))
        z, gate = rng.standard_normal((2, 5, DV)).astype(np.float32)
        want = norm(torch.from_numpy(z), torch.from_numpy(gate)).numpy()
    got = gdn.rms_norm_gated(z, gate, norm.weight.detach().numpy(), 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_prompt_in_several_steps_carries_its_states() -> None:
    """Chunked prefill: 150 tokens as 70 + 1 + 79 (each step from the last one's states)
    equal one run, for the delta rule and the conv."""
    rng = np.random.default_rng(11)
    x = inputs(rng, 150)
    cx = rng.standard_normal((150, CONV_DIM)).astype(np.float32)
    w = rng.standard_normal((WIDTH, CONV_DIM)).astype(np.float32)
    whole_o, whole_s = gdn.gated_delta_rule_chunked(*x, jnp.zeros((HV, DK, DV)))
    whole_y, whole_c = gdn.causal_conv1d(cx, w, jnp.zeros((WIDTH - 1, CONV_DIM)))
    s, c, outs, ys = jnp.zeros((HV, DK, DV)), jnp.zeros((WIDTH - 1, CONV_DIM)), [], []
    for a, b in ((0, 70), (70, 71), (71, 150)):
        o, s = gdn.gated_delta_rule_chunked(*(t[a:b] for t in x), s)
        y, c = gdn.causal_conv1d(cx[a:b], w, c)
        outs.append(o)
        ys.append(y)
    np.testing.assert_allclose(np.concatenate(outs), whole_o, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(s, whole_s, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.concatenate(ys), whole_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(c, whole_c)
    want_y, want_c = conv_oracle(cx, w, np.zeros((WIDTH - 1, CONV_DIM)))
    np.testing.assert_allclose(whole_y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(whole_c, want_c)


RAGGED_FORMS = {"recurrent": gdn.ragged_gated_delta_rule,
                # chunks of 4: the 7-token chunk spans two, one ends mid-chunk
                "chunked": functools.partial(gdn.ragged_gated_delta_rule_chunked, chunk_size=4)}


@pytest.mark.parametrize("form", list(RAGGED_FORMS))
def test_ragged_batch_equals_each_sequence_alone(form: str) -> None:
    """A step of a 7-token prompt chunk (fresh), a 2-token chunk (continuing), a decode and
    a 1-token prompt (fresh), then padding: each sequence's output rows and slots equal its
    own run; the slots of other sequences and padding rows are left alone."""
    rng = np.random.default_rng(5)
    lens, has_initial, slots = [7, 2, 1, 1], [False, True, True, False], [3, 1, 6, 2]
    num_tokens, max_seqs, num_slots = 16, 6, 8
    q, k, v, g, beta = inputs(rng, num_tokens)
    cx = rng.standard_normal((num_tokens, CONV_DIM)).astype(np.float32)
    w = rng.standard_normal((WIDTH, CONV_DIM)).astype(np.float32)
    states = rng.standard_normal((num_slots, HV, DK, DV)).astype(np.float32)
    conv_states = rng.standard_normal((num_slots, WIDTH - 1, CONV_DIM)).astype(np.float32)
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:len(lens) + 1] = np.cumsum(lens)
    cu[len(lens) + 1:] = cu[len(lens)]
    slot_arr = np.array(slots + [0] * (max_seqs - len(lens)), np.int32)  # padding names slot 0
    has = np.array(has_initial + [True] * (max_seqs - len(lens)))
    num = jnp.int32(len(lens))
    o, new_states = jax.jit(RAGGED_FORMS[form])(q, k, v, g, beta, states, slot_arr, cu, num, has)
    y, new_conv = jax.jit(gdn.ragged_causal_conv1d)(cx, w, conv_states, slot_arr, cu, num, has)
    for i, (n, initial, slot) in enumerate(zip(lens, has_initial, slots)):
        a, b = cu[i], cu[i] + n
        start = states[slot] if initial else np.zeros((HV, DK, DV), np.float32)
        want_o, want_s = oracle(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], start)
        np.testing.assert_allclose(o[a:b], want_o, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(new_states[slot], want_s, rtol=2e-4, atol=2e-4)
        c0 = conv_states[slot] if initial else np.zeros((WIDTH - 1, CONV_DIM), np.float32)
        want_y, want_c = conv_oracle(cx[a:b], w, c0)
        np.testing.assert_allclose(y[a:b], want_y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(new_conv[slot], want_c, rtol=1e-6)
    untouched = np.array([s for s in range(num_slots) if s not in slots])
    np.testing.assert_array_equal(new_states[untouched], states[untouched])
    np.testing.assert_array_equal(new_conv[untouched], conv_states[untouched])
    assert not np.any(o[cu[len(lens)]:]) and not np.any(y[cu[len(lens)]:])
