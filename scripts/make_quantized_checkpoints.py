"""Write the tiny quantized checkpoints under tests/data/quantized/ and their references.

Run in a venv of its own, never the suite's (llmcompressor pins its own transformers and
compressed-tensors):

    python -m venv /tmp/lc-venv && /tmp/lc-venv/bin/pip install torch==2.13.0 "llmcompressor==0.14.*"
    /tmp/lc-venv/bin/python scripts/make_quantized_checkpoints.py tests/data/quantized

Each checkpoint is a tiny random model quantized data-free by llmcompressor's `oneshot`
(compressed-tensors formats), or, for the block-wise `fp8` format no library here writes,
from known float8 values and block scales. Beside each, `reference.json` holds what
transformers computes on the *dequantized* float model (compressed-tensors' own
decompression, or the format's formula for `fp8`): prompt logprobs and greedy tokens, and,
where transformers runs the quantized checkpoint on the CPU itself, its logprobs too. The
tests compare jaxserve's engine to these, so the reference never goes through our loader.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
import transformers

PROMPT = list(range(3, 40))  # prompt logprobs over these ids
GREEDY_PROMPT = list(range(3, 11))
GREEDY_TOKENS = 12

LLAMA = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
QWEN3_MOE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)


def tiny(kind: str, seed: int) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE))
    with torch.no_grad():  # random init leaves norms at 1: perturb them so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.float()


def int_group(bits: int, group: int, symmetric: bool = True) -> dict:
    return {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group",
        "group_size": group}}}


def fp8_tensor() -> dict:  # one scale per tensor (FP8's weights), activations dynamic per token
    return {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                              "strategy": "token", "dynamic": True}}}


def fp8_block(block: list[int]) -> dict:
    return {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
        "block_structure": block}, "input_activations": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
        "group_size": block[1], "dynamic": True}}}


# name -> (model kind, llmcompressor scheme name or config_groups, ignore)
COMPRESSED = {
    "llama-fp8-dynamic": ("llama", "FP8_DYNAMIC", ["lm_head"]),  # fp8 per channel
    "llama-fp8-tensor": ("llama", fp8_tensor(), ["lm_head"]),
    "llama-fp8-block": ("llama", fp8_block([64, 64]), ["lm_head"]),
    "llama-w8a16": ("llama", "W8A16", ["lm_head"]),  # int8 per channel, pack-quantized
    "llama-w4a16": ("llama", int_group(4, 32), ["lm_head"]),
    "llama-w4a16-asym": ("llama", int_group(4, 32, symmetric=False), ["lm_head"]),
    "qwen3moe-w4a16": ("qwen3_moe", int_group(4, 32), ["lm_head", "re:.*mlp.gate$"]),
}


def logprobs(model: transformers.PreTrainedModel) -> dict:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        prompt_lp = [float(lp[i, PROMPT[i + 1]]) for i in range(len(PROMPT) - 1)]
        out = model.generate(torch.tensor([GREEDY_PROMPT]), max_new_tokens=GREEDY_TOKENS,
                             do_sample=False, min_new_tokens=GREEDY_TOKENS, eos_token_id=None,
                             pad_token_id=0)
    return {"prompt_logprobs": prompt_lp, "greedy": out[0, len(GREEDY_PROMPT):].tolist()}


def decompressed(path: str, kind: str) -> transformers.PreTrainedModel:
    """compressed-tensors' own decompression of the saved checkpoint, its float weights put
    into a plain model: weights only, as jaxserve runs them (a decompressed model keeps
    quantizing its activations where the scheme says so)."""
    cfg = transformers.CompressedTensorsConfig(run_compressed=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=cfg, dtype=torch.float32)
    plain = tiny(kind, 0)
    state = {k: v.float() for k, v in model.state_dict().items() if k in plain.state_dict()}
    assert set(state) == set(plain.state_dict()), set(plain.state_dict()) - set(state)
    plain.load_state_dict(state)
    return plain


def make_compressed(out: str, name: str, kind: str, scheme, ignore: list[str], seed: int) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    float_dir = os.path.join(out, ".float", name)  # oneshot reads the config from a path
    tiny(kind, seed).save_pretrained(float_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    kw = {"scheme": scheme} if isinstance(scheme, str) else {"config_groups": scheme}
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", ignore=ignore, **kw),
            pipeline="datafree")
    path = os.path.join(out, name)
    model.save_pretrained(path, save_compressed=True)
    ref = logprobs(decompressed(path, kind))
    try:  # transformers running the compressed checkpoint itself (activations quantized too)
        own = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ref["transformers_quantized"] = logprobs(own)
    except Exception as e:  # noqa: BLE001 (recorded, not fatal: not every scheme runs on the CPU)
        ref["transformers_quantized_error"] = f"{type(e).__name__}: {e}"[:300]
    with open(os.path.join(path, "reference.json"), "w") as f:
        json.dump(ref, f)


def make_block_fp8(out: str, block: tuple[int, int] = (64, 64), seed: int = 7) -> None:
    """The block-wise `fp8` format of Qwen3-FP8 and DeepSeek: `weight` float8_e4m3fn and
    `weight_scale_inv` [ceil(out / b0), ceil(in / b1)], w = weight * scale_inv per block."""
    from safetensors.torch import save_file

    model = tiny("llama", seed)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    quantized = {}
    for key, w in state.items():
        if not key.endswith("_proj.weight"):
            quantized[key] = w
            continue
        o, i = w.shape
        bo, bi = -(-o // block[0]), -(-i // block[1])
        pad = torch.zeros(bo * block[0], bi * block[1])
        pad[:o, :i] = w
        blocks = pad.reshape(bo, block[0], bi, block[1])
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        q = (blocks / scale[:, None, :, None]).reshape(pad.shape)[:o, :i].to(torch.float8_e4m3fn)
        quantized[key] = q
        quantized[key + "_scale_inv"] = scale.float()
        rows = torch.arange(o)[:, None] // block[0]
        cols = torch.arange(i)[None, :] // block[1]
        deq = q.float() * scale[rows, cols]
        state[key] = deq
    path = os.path.join(out, "llama-fp8-blockwise")
    os.makedirs(path, exist_ok=True)
    save_file(quantized, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    model.load_state_dict(state)
    with open(os.path.join(path, "reference.json"), "w") as f:
        json.dump(logprobs(model), f)


def main(out: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    for seed, (name, (kind, scheme, ignore)) in enumerate(COMPRESSED.items()):
        make_compressed(out, name, kind, scheme, ignore, seed)
    make_block_fp8(out)
    shutil.rmtree(os.path.join(out, ".float"))
    for name in sorted(os.listdir(out)):
        size = sum(os.path.getsize(os.path.join(out, name, f)) for f in os.listdir(os.path.join(out, name)))
        print(f"{name}: {size // 1024} KiB")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/quantized")
