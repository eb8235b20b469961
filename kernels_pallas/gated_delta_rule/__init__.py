"""Gated DeltaNet (Qwen3-Next, Qwen3.5): linear attention with a fixed-size recurrent state per
sequence, in place of KV pages that grow with the context.

Each linear-attention layer keeps, per running sequence, two states in a slot of its own:

    conv_state   [num_slots, kernel - 1, conv_dim]      the last inputs of the causal conv
    state        [num_slots, num_v_heads, dk, dv]       the delta rule's S (float32)

`reference.py` holds the plain `jax.numpy` forms (the recurrent one for decode, the chunked
one for prefill, and their ragged batch contract); the device kernels are to sit beside it
with the same signatures, tested against it.
"""
