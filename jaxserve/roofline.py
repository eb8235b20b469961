"""The ideal of one engine step, computed from the model's shape alone (no compiler), and its
roofline time on a chip from jaxserve/chips.py: the upper bound a step can reach there.

    bytes  = weights read once at their stored width (a mixture of experts: the experts the
             step's tokens can reach), + the KV values the batch reads (2 x kv_heads x
             head_dim x value bytes per token of context and layer; a cache layout's padding
             is waste, not ideal) and writes, + the hidden states between layers and the logits
    flops  = 2 x the active weights x tokens (the LM head on the rows sampled only), + attention
             (4 x heads x head_dim per token and context position, per layer)
    time   = max(bytes / HBM bandwidth, flops / matmul peak) over the devices tensor
             parallelism splits the step across (pipeline stages run one after another)

Figures only; no JAX here. The preflight's `--roofline` prints them (jaxserve/preflight.py).
"""

from __future__ import annotations

import dataclasses
import math

from jaxserve.chips import Chip
from jaxserve.models.arch_config import ArchConfig


@dataclasses.dataclass(frozen=True)
class Step:
    """One step's shape: `batch` sequences at `context` tokens each, `tokens` computed."""

    kind: str  # "decode" or "prefill"
    batch: int
    context: int  # tokens of context each sequence attends over (prefill: after the chunk)
    tokens: int  # tokens computed this step (decode: one per sequence; prefill: the chunk)
    sampled: int  # rows through the LM head


def decode(batch: int, context: int) -> Step:
    return Step("decode", batch, context, batch, batch)


def prefill(chunk: int) -> Step:
    """One prompt's first `chunk` tokens (context = the chunk itself)."""
    return Step("prefill", 1, chunk, chunk, 1)


@dataclasses.dataclass(frozen=True)
class Ideal:
    weight_bytes: float
    kv_bytes: float
    activation_bytes: float
    flops: float
    attention_flops: float
    head_bytes: float = 0.0  # of weight_bytes, the LM head's (the sampler program reads it)
    state_bytes: float = 0.0  # linear-attention layers' states read and written

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes + self.state_bytes


def expert_params(arch: ArchConfig, tokens: int) -> float:
    """Of `weight_params`, the experts' (every sparse layer's experts the tokens reach)."""
    sparse = (sum(arch.moe_layers) if arch.moe_layers is not None
              else arch.num_hidden_layers if arch.num_experts else 0)
    E, k = arch.num_experts, arch.num_experts_per_tok
    experts = E * (1 - (1 - k / E) ** tokens) if E else 0
    return sparse * experts * 3 * arch.hidden_size * arch.moe_intermediate_size


def weight_params(arch: ArchConfig, tokens: int) -> tuple[float, float]:
    """(parameters a step of `tokens` reads, of which the LM head's): every dense weight, and
    of each mixture-of-experts layer the experts its tokens reach, in expectation when each
    token picks its top-k uniformly: E x (1 - (1 - k/E)^tokens)."""
    H = arch.hidden_size
    # q_proj, twice as wide with an output gate per head (the hybrids' full layers), o, k, v.
    attention = (3 if arch.attn_output_gate else 2) * H * arch.q_size + 2 * H * arch.kv_size
    la = arch.linear_attention
    # A Gated DeltaNet layer: in_proj_qkv, z, b, a, out_proj and the convolution's taps.
    linear = (H * (la.conv_dim + 2 * la.value_dim + 2 * la.num_value_heads)
              + la.conv_kernel * la.conv_dim) if la is not None else 0
    linear_layers = set(arch.linear_layers)
    dense_mlp = 3 * H * arch.intermediate_size
    sparse = (arch.moe_layers if arch.moe_layers is not None
              else (bool(arch.num_experts),) * arch.num_hidden_layers)
    E, k = arch.num_experts, arch.num_experts_per_tok
    experts = E * (1 - (1 - k / E) ** tokens) if E else 0
    # The router, the experts reached, and a shared expert with its gate (Qwen3-Next) if any.
    moe_mlp = (H * arch.num_experts + experts * 3 * H * arch.moe_intermediate_size
               + H * (3 * arch.shared_expert_intermediate_size + 1) * bool(
                   arch.shared_expert_intermediate_size))
    layers = sum((linear if i in linear_layers else attention) + (moe_mlp if s else dense_mlp)
                 for i, s in enumerate(sparse))
    head = arch.vocab_size * H
    return layers + head, head


def ideal_step(arch: ArchConfig, step: Step, weight_bytes_per_param: float,
               kv_bytes_per_value: float, act_bytes: float = 2.0,
               head_bytes_per_param: float | None = None,
               experts_bytes_per_param: float | None = None) -> Ideal:
    """The step's ideal bytes and flops (the whole model, every device together). The LM
    head's width is the weights' unless `head_bytes_per_param` says otherwise (a checkpoint
    stored quantized keeps its head in bf16); the experts' likewise with
    `experts_bytes_per_param` (GPT-OSS's 4-bit experts beside bf16 weights)."""
    params, head = weight_params(arch, step.tokens)
    head_width = weight_bytes_per_param if head_bytes_per_param is None else head_bytes_per_param
    experts = 0.0 if experts_bytes_per_param is None else expert_params(arch, step.tokens)
    L = len(arch.attention_layers)  # the layers with a KV cache
    local = arch.local_layers or (((arch.sliding_window is not None),) * L)
    # Each layer reads every sequence's context (a sliding layer: its window), and writes the
    # step's new tokens.
    seen = [min(step.context, arch.sliding_window) if is_local and arch.sliding_window
            else step.context for is_local in local]
    per_token_layer = 2 * arch.kv_size * kv_bytes_per_value
    kv = per_token_layer * (step.batch * sum(seen) + step.tokens * L)
    attended: float  # query-key pairs
    if step.kind == "decode":
        attended = step.tokens * sum(seen)
    else:  # causal: the chunk's i-th token attends over i earlier ones (capped by the window)
        attended = sum(sum(min(i + 1, s) for i in range(step.tokens)) if s < step.context
                       else step.tokens * (step.tokens + 1) / 2 for s in seen)
    attention_flops = 4 * arch.q_size * attended
    # Linear-attention layers: each sequence's states read and written once a step (the
    # convolution's inputs at the activations' width, the delta rule's S in float32), and per
    # token ~6 x heads x dk x dv flops (decay, S^T k, the rank-one write, S^T q).
    la, linear = arch.linear_attention, len(arch.linear_layers)
    states = 2 * step.batch * linear * la.state_bytes(int(act_bytes)) if la else 0.0
    if la:
        attention_flops += (6 * la.num_value_heads * la.key_head_dim * la.value_head_dim
                            * step.tokens * linear)
    flops = 2 * (params - head) * step.tokens + 2 * head * step.sampled + attention_flops
    activations = (2 * step.tokens * arch.hidden_size * act_bytes * arch.num_hidden_layers
                   + step.sampled * arch.vocab_size * 4)
    weights = ((params - head - experts) * weight_bytes_per_param + head * head_width
               + experts * (experts_bytes_per_param or 0.0))
    return Ideal(weights, kv, activations,
                 flops, attention_flops, head * head_width, states)


@dataclasses.dataclass(frozen=True)
class Roofline:
    ideal: Ideal
    seconds: float  # the step's roofline time
    bound: str  # "memory" or "compute"
    tokens_per_s: float  # decode: sequences' new tokens; prefill: prompt tokens

    @property
    def attention_share(self) -> float:
        """The attention's share of the step (its KV bytes or its flops, as bound)."""
        i = self.ideal
        return i.kv_bytes / i.bytes if self.bound == "memory" else i.attention_flops / i.flops


def roofline(chip: Chip, ideal: Ideal, step: Step, devices: int, weights: str) -> Roofline:
    """`ideal` on `devices` devices of `chip` (tensor parallel), matmuls at the peak for
    `weights` ("bf16", "fp8", "int8"). ValueError naming the table for a figure it lacks."""
    peak = chip.peak_flops(weights)
    if chip.hbm_bytes_per_s is None or peak is None:
        raise ValueError(f"jaxserve/chips.py's CHIPS table has no bandwidth or peak for "
                         f"{chip.name!r} ({chip.source}): no roofline for it")
    share = devices / chip.devices_per_chip  # chips' worth of bandwidth and units
    t_mem = ideal.bytes / (chip.hbm_bytes_per_s * share)
    t_flops = ideal.flops / (peak * share)
    seconds = max(t_mem, t_flops)
    return Roofline(ideal, seconds, "memory" if t_mem >= t_flops else "compute",
                    step.tokens / seconds)


def usd_per_million_tokens(usd_per_chip_hour: float | None, devices: int, chip: Chip,
                           tokens_per_s: float) -> float | None:
    """Dollars per million output tokens at `tokens_per_s` (None without a price)."""
    if usd_per_chip_hour is None or tokens_per_s <= 0:
        return None
    chips = math.ceil(devices / chip.devices_per_chip)
    return usd_per_chip_hour * chips / (tokens_per_s * 3600) * 1e6


DECODE_BATCHES = (1, 16, 64)  # and max_num_seqs
CONTEXTS = (1024, 8192)
PREFILL_CHUNKS = (512, 2048)


@dataclasses.dataclass(frozen=True)
class Row:
    """One step of the --roofline table (JSON: `rows`)."""

    target: str
    program: str  # "decode" or "prefill"
    batch: int
    context: int
    bucket: int | None  # the token bucket the step runs in (None: more than the largest)
    ideal_bytes: float
    ideal_flops: float
    roofline_s: float
    bound: str
    est_tokens_per_s: float
    attention_share: float
    padding_share: float  # of the bucket's tokens, the padding's
    head_bytes: float  # of ideal_bytes, the LM head's weights
    # What the compiler says of the same step (jaxserve/worker/program_cost.py); None where a
    # program is not costed, never 0.
    compiled_bytes: float | None = None
    compiled_flops: float | None = None
    # (flops, bytes) of each part: "forward" (XLA's ops), "attention" (the kernel's plan),
    # "sampler"; None when not costed.
    compiled_parts: dict[str, tuple[float, float]] | None = None
    temp_bytes: int | None = None  # the forward program's temp at that bucket (the preflight's)

    @property
    def sampler_share(self) -> float | None:
        """The compiled sampler's bytes beyond the LM head's weights (its [rows, vocab] work:
        logits, processors, argmax, logprobs), as a share of the ideal step's bytes."""
        if self.compiled_parts is None:
            return None
        return max(0.0, self.compiled_parts["sampler"][1] - self.head_bytes) / self.ideal_bytes


def steps(max_num_seqs: int, max_model_len: int) -> list[Step]:
    """The steps --roofline estimates: decode at 1, 16, 64 and max_num_seqs sequences of 1k
    and 8k tokens of context, prefill in 512- and 2048-token chunks (within max_model_len)."""
    batches = sorted({b for b in (*DECODE_BATCHES, max_num_seqs) if b <= max_num_seqs})
    contexts = [c for c in CONTEXTS if c <= max_model_len] or [max_model_len]
    out = [decode(b, c) for c in contexts for b in batches]
    return out + [prefill(c) for c in PREFILL_CHUNKS if c <= max_model_len]


def rows(target: str, chip: Chip, arch: ArchConfig, devices: int, weights: str,
         weight_bytes_per_param: float, kv_bytes_per_value: float, act_bytes: float,
         max_num_seqs: int, max_model_len: int, buckets: tuple[int, ...],
         head_bytes_per_param: float | None = None,
         experts_bytes_per_param: float | None = None) -> list[Row]:
    """The --roofline rows of one target (ValueError naming the table for a chip it lacks)."""
    out = []
    for step in steps(max_num_seqs, max_model_len):
        ideal = ideal_step(arch, step, weight_bytes_per_param, kv_bytes_per_value, act_bytes,
                           head_bytes_per_param, experts_bytes_per_param)
        r = roofline(chip, ideal, step, devices, weights)
        bucket = next((b for b in buckets if b >= step.tokens), None)
        out.append(Row(
            target, step.kind, step.batch, step.context, bucket, ideal.bytes, ideal.flops,
            r.seconds, r.bound, r.tokens_per_s, r.attention_share,
            0.0 if bucket is None else 1 - step.tokens / bucket, ideal.head_bytes))
    return out


def estimate(rows_: list[Row], batch: int, context: int = CONTEXTS[0]) -> float | None:
    """Decode tok/s at `batch` sequences (the nearest smaller batch estimated) and `context`."""
    found = [r for r in rows_ if r.program == "decode" and r.batch <= batch]
    if not found:
        return None
    near = min({r.context for r in found}, key=lambda c: abs(c - context))
    best = max((r for r in found if r.context == near), key=lambda r: r.batch)
    return best.est_tokens_per_s
