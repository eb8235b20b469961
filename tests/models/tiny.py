"""Tiny random Hugging Face checkpoints and a one-sequence forward pass for model tests."""

from __future__ import annotations

import os

import numpy as np

TINY_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,  # as SmolLM2; test_separate_lm_head covers the other case
)


def save_tiny_hf(kind: str, out_dir: str, seed: int = 0, **overrides) -> str:
    """Save a randomly initialised transformers model of `kind` as an HF directory."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg_kwargs = {**TINY_COMMON, **overrides}
    if kind == "llama":
        cfg = transformers.LlamaConfig(**cfg_kwargs)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**cfg_kwargs)
        model = transformers.MistralForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**cfg_kwargs)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=32, **cfg_kwargs)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif kind == "gemma2":
        cfg = transformers.Gemma2Config(head_dim=16, **cfg_kwargs)
        model = transformers.Gemma2ForCausalLM(cfg)
    elif kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(head_dim=16, **cfg_kwargs)
        model = transformers.Gemma3ForCausalLM(cfg)
    elif kind == "phi3":
        cfg = transformers.Phi3Config(pad_token_id=0, bos_token_id=1, eos_token_id=2, **cfg_kwargs)
        model = transformers.Phi3ForCausalLM(cfg)
    elif kind == "qwen3_moe":
        cfg_kwargs = {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                      "norm_topk_prob": True, "head_dim": 16, **cfg_kwargs}
        cfg = transformers.Qwen3MoeConfig(**cfg_kwargs)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif kind == "gpt_oss":  # alternating sliding and full layers by default
        cfg_kwargs = {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                      "sliding_window": 8, **cfg_kwargs}
        cfg = transformers.GptOssConfig(**cfg_kwargs)
        model = transformers.GptOssForCausalLM(cfg)
    elif kind == "mixtral":
        cfg_kwargs = {"num_local_experts": 4, "num_experts_per_tok": 2, **cfg_kwargs}
        cfg = transformers.MixtralConfig(**cfg_kwargs)
        model = transformers.MixtralForCausalLM(cfg)
    elif kind in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):  # Gated DeltaNet hybrids: 3 linear
        # layers, 1 full; the MoE forms with a shared expert, Qwen3-Next a dense layer among them
        cfg_kwargs = {"head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                      "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                      "linear_conv_kernel_dim": 4, **cfg_kwargs,
                      "num_hidden_layers": overrides.get("num_hidden_layers", 4)}
        moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
               "shared_expert_intermediate_size": 24}
        if kind == "qwen3_5":
            cfg = transformers.Qwen3_5TextConfig(**cfg_kwargs)
            model = transformers.Qwen3_5ForCausalLM(cfg)
        elif kind == "qwen3_5_moe":
            cfg_kwargs.pop("intermediate_size", None)
            cfg = transformers.Qwen3_5MoeTextConfig(**moe, **cfg_kwargs)
            model = transformers.Qwen3_5MoeForCausalLM(cfg)
        else:
            cfg = transformers.Qwen3NextConfig(**moe, mlp_only_layers=[1], **cfg_kwargs)
            model = transformers.Qwen3NextForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # Random init leaves norms at 1 and biases at 0; perturb them so a mix-up shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "sinks")):
                p.add_(0.1 * torch.randn_like(p))
    path = os.path.join(out_dir, kind)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_logits(model_dir: str, token_ids: list[int]) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


def hf_greedy(model_dir: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> np.ndarray:
    """log p(prompt[i] | prompt[:i]) for i >= 1, from transformers' logits."""
    import torch

    logits = torch.tensor(hf_logits(model_dir, prompt), dtype=torch.float64)
    lp = torch.log_softmax(logits, -1)[:-1]
    return lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy()


def on_fake_devices(model_dir: str, configs: list[list], prompts: list[list[int]]) -> dict:
    """tests/parallel/tiny_model_worker.py's results for `configs` ([tp, expert_parallel]
    each), in a subprocess with 4 fake CPU devices."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-m", "tests.parallel.tiny_model_worker", model_dir,
         json.dumps(configs), json.dumps(prompts)], cwd=root, capture_output=True, text=True,
        timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))
