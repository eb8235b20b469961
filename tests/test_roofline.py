"""The roofline's ideal step against hand-counted figures, and the chip table's refusals."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve import roofline
from jaxserve.chips import CHIPS, chip, chip_for_device, parse_prices
from jaxserve.models.arch_config import ArchConfig

# 2 layers, hidden 8, 2 query heads and 1 KV head of 4, MLP 16, vocabulary 100.
TINY = ArchConfig("LlamaForCausalLM", vocab_size=100, hidden_size=8, intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4)


def test_decode_step_matches_the_hand_count() -> None:
    # Per layer: q, o 8x8 each, k, v 8x4 each = 192; gate, up, down 8x16 each = 384.
    # Two layers 1152, the LM head 100x8 = 800: 1952 parameters.
    ideal = roofline.ideal_step(TINY, roofline.decode(batch=2, context=10),
                                weight_bytes_per_param=2, kv_bytes_per_value=2)
    assert ideal.weight_bytes == 1952 * 2
    # K and V: 2 x 4 values x 2 B = 16 B per token and layer; read 2 x 10 x 2 layers, written
    # 2 tokens x 2 layers.
    assert ideal.kv_bytes == 16 * (40 + 4)
    # 2 x 1152 x 2 tokens + 2 x 800 x 2 rows + attention 4 x 8 (q width) x (2 tokens x 20).
    assert ideal.attention_flops == 4 * 8 * 40
    assert ideal.flops == 2 * 1152 * 2 + 2 * 800 * 2 + 4 * 8 * 40
    # Hidden states in and out of each layer (2 B), float32 logits.
    assert ideal.activation_bytes == 2 * 2 * 8 * 2 * 2 + 2 * 100 * 4


def test_prefill_attends_causally_and_samples_one_row() -> None:
    ideal = roofline.ideal_step(TINY, roofline.prefill(4), 2, 2)
    assert ideal.attention_flops == 4 * 8 * (1 + 2 + 3 + 4) * 2  # per layer, two layers
    assert ideal.flops == 2 * 1152 * 4 + 2 * 800 * 1 + ideal.attention_flops


def test_sliding_layers_read_their_window_and_experts_their_reach() -> None:
    windowed = dataclasses.replace(TINY, sliding_window=4)
    ideal = roofline.ideal_step(windowed, roofline.decode(1, 10), 2, 2)
    assert ideal.kv_bytes == 16 * (1 * 4 * 2 + 1 * 2)
    moe = dataclasses.replace(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4)
    one, _ = roofline.weight_params(moe, tokens=1)  # 2 experts of 3 x 8 x 4, router 8 x 8
    two, _ = roofline.weight_params(moe, tokens=2)  # 8 x (1 - (3/4)^2) = 3.5 expected
    many, _ = roofline.weight_params(moe, tokens=64)  # all 8, nearly surely
    assert one == pytest.approx(2 * (192 + 64 + 2 * 96) + 800)
    assert two == pytest.approx(2 * (192 + 64 + 3.5 * 96) + 800)
    assert many == pytest.approx(2 * (192 + 64 + 8 * 96) + 800)
    # 4-bit experts beside bf16 weights (GPT-OSS's MXFP4): the reached experts at their width.
    bf16 = roofline.ideal_step(moe, roofline.decode(1, 10), 2, 2)
    mxfp4 = roofline.ideal_step(moe, roofline.decode(1, 10), 2, 2, experts_bytes_per_param=0.5)
    assert bf16.weight_bytes - mxfp4.weight_bytes == pytest.approx(2 * 2 * 96 * 1.5)


def test_a_hybrids_linear_layers_read_and_write_their_states_not_pages() -> None:
    """TINY with its first layer Gated DeltaNet (2 key heads, 4 value heads of 4, kernel 4) and
    the second a gated full-attention layer, hand-counted."""
    from jaxserve.models.arch_config import LinearAttention

    la = LinearAttention(num_key_heads=2, num_value_heads=4, key_head_dim=4, value_head_dim=4,
                         conv_kernel=4)
    hybrid = dataclasses.replace(TINY, layer_types=("linear_attention", "full_attention"),
                                 linear_attention=la, attn_output_gate=True, norm_offset=1.0)
    params, head = roofline.weight_params(hybrid, tokens=1)
    # linear: qkv 8 x 32, z 8 x 16, b and a 8 x 4 each, out 16 x 8, conv 4 x 32 = 704;
    # full: q (with its gate) 8 x 16, o 8 x 8, k, v 8 x 4 each = 256; MLPs 2 x 384; head 800.
    assert (params, head) == (704 + 256 + 2 * 384 + 800, 800)
    ideal = roofline.ideal_step(hybrid, roofline.decode(batch=2, context=10), 2, 2)
    assert ideal.kv_bytes == 16 * (20 + 2)  # the full layer alone
    # Per sequence, read and written: conv 3 x 32 x 2 B + S 4 x 4 x 4 x 4 B = 448 B.
    assert ideal.state_bytes == 2 * 2 * 448
    assert ideal.bytes == ideal.weight_bytes + ideal.kv_bytes + ideal.activation_bytes + 1792
    assert ideal.attention_flops == 4 * 8 * 20 + 6 * 4 * 4 * 4 * 2
    # The MoE form (Qwen3-Next): a token reaches 2 of 8 experts of 3 x 8 x 4, the router 8 x 8,
    # and the shared expert (3 x 8 x 6) with its gate (8 x 1), in each layer.
    moe = dataclasses.replace(hybrid, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4,
                              shared_expert_intermediate_size=6)
    params, _ = roofline.weight_params(moe, tokens=1)
    assert params == 704 + 256 + 2 * (64 + 2 * 96 + 144 + 8) + 800


def test_roofline_time_is_the_slower_of_bandwidth_and_peak() -> None:
    v6e = chip("v6e")
    ideal = roofline.Ideal(weight_bytes=1638e9, kv_bytes=0, activation_bytes=0, flops=918e12 / 2,
                           attention_flops=0)
    r = roofline.roofline(v6e, ideal, roofline.decode(4, 1), devices=1, weights="bf16")
    assert r.seconds == pytest.approx(1.0) and r.bound == "memory" and r.tokens_per_s == pytest.approx(4)
    # tpu7x: a device is one of the chip's two TensorCores, half its bandwidth.
    t = roofline.roofline(chip("tpu7x"), ideal, roofline.decode(4, 1), devices=1, weights="bf16")
    assert t.seconds == pytest.approx(1638e9 / (7380e9 / 2))
    # Eight chips for an hour make 3600 x 1000 tokens.
    usd = roofline.usd_per_million_tokens(2.70, 8, v6e, tokens_per_s=1000)
    assert usd == pytest.approx(2.70 * 8 / 3.6)


def test_chips_missing_from_the_table_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="CHIPS table"):
        chip("v9")
    ideal = roofline.ideal_step(TINY, roofline.decode(1, 10), 2, 2)
    with pytest.raises(ValueError, match="CHIPS table has no bandwidth"):
        roofline.roofline(CHIPS["v4"], ideal, roofline.decode(1, 10), 1, "bf16")
    with pytest.raises(ValueError, match="--price"):
        parse_prices(["tpu7x"])
    with pytest.raises(ValueError, match="CHIPS table"):
        parse_prices(["v9=1.0"])
    assert parse_prices(["tpu7x=6.5"]) == {"tpu7x": 6.5}


def test_every_priced_chip_has_its_figures_and_sources() -> None:
    for c in CHIPS.values():
        assert c.source
        if c.usd_per_hour is not None:
            assert c.hbm_bytes_per_s and c.bf16_flops, c.name


def test_a_devices_kind_names_its_chip() -> None:
    """The device check reads the chip from JAX's device_kind (no chip: no roofline)."""
    assert chip_for_device("NVIDIA H200") is CHIPS["h200"]
    assert chip_for_device("NVIDIA H100 80GB HBM3") is CHIPS["h100"]
    assert chip_for_device("TPU v6 lite") is CHIPS["v6e"]
    assert chip_for_device("TPU7x") is CHIPS["tpu7x"]
    assert chip_for_device("cpu") is None and chip_for_device("NVIDIA A100-SXM4-80GB") is None


def test_compiled_cost_of_a_hand_counted_program_and_a_scan_counted_once() -> None:
    """`cost_analysis` of six float32 matmul layers on the CPU equals the hand count (each
    weight read once; x read and written by the dot and the tanh), and a scan over the same
    layers is counted as one layer: why --roofline costs an unrolled copy of a scanned
    forward (jaxserve/worker/program_cost.py)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.worker.programs import cost_analysis

    L, D, T = 6, 256, 8
    x, w = jax.ShapeDtypeStruct((T, D), jnp.float32), jax.ShapeDtypeStruct((D, D), jnp.float32)

    def layers(x, *ws):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    flops, nbytes = cost_analysis(jax.jit(layers).trace(x, *[w] * L).lower().compile())
    assert flops == 2 * T * D * D * L
    assert nbytes == L * D * D * 4 + L * 4 * T * D * 4
    stack = jax.ShapeDtypeStruct((L, D, D), jnp.float32)
    scanned = jax.jit(lambda x, ws: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0])
    flops, _ = cost_analysis(scanned.trace(x, stack).lower().compile())
    assert 0 <= flops - 2 * T * D * D < 8  # one layer (and the loop counter's add and compare)
