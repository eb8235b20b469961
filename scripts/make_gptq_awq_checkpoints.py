"""Write tiny GPTQ and AWQ checkpoints under tests/data/quantized/ and their references.

    /tmp/lc-venv/bin/python scripts/make_gptq_awq_checkpoints.py tests/data/quantized \
        --library-reference /tmp/gptq-venv/bin/python

(the venv of scripts/make_quantized_checkpoints.py: torch and transformers; the second, that of
scripts/gptq_awq_library_reference.py.) No library here
writes these formats on a CPU, so each tiny random Llama is quantized in this script and its
integers packed by the formats' published layouts, written out element by element:

    GPTQ  qweight int32 [in / p, out], p = 32 / bits: bits [bits*i, bits*(i+1)) of row r hold
          input p*r + i. qzeros int32 [groups, out / p]: output p*c + i at bits*i; the v1
          format ("gptq") stores zero - 1 masked to the width, gptq_v2 the zero. scales fp16
          [groups, out]; g_idx int32 [in]. w = (q - zero) * scale of the input's group.
    AWQ   qweight int32 [in, out / 8]: nibble i of word c holds output 8c + [0,2,4,6,1,3,5,7][i];
          qzeros the same over [groups, out]; scales fp16 [groups, out]; w = (q - zero) * scale.

reference.json holds transformers' prompt logprobs and greedy tokens on the float model whose
weights are those integers dequantized by the formula above, so the reference never goes
through jaxserve's loader. With --library-reference it also holds gptqmodel's own reading of
each checkpoint through transformers (`library_dequantized`: its dequantization in float32,
which checks this script's packing; `transformers_quantized`: its fp16 CPU kernels).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from make_quantized_checkpoints import logprobs, tiny  # noqa: E402

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize(w: np.ndarray, bits: int, g_idx: np.ndarray, groups: int, sym: bool
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [out, in] float -> q [in, out] unsigned, zero [groups, out], scale fp16 [groups, out]."""
    maxq = (1 << bits) - 1
    out, n_in = w.shape
    scale = np.zeros((groups, out), np.float16)
    zero = np.zeros((groups, out), np.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
        if sym:
            amax = np.maximum(-lo, hi)
            lo, hi = -amax, amax
        scale[g] = np.maximum((hi - lo) / maxq, 1e-8)
        zero[g] = (1 << (bits - 1)) if sym else np.clip(np.round(-lo / scale[g].astype(np.float32)), 0, maxq)
    s = scale.astype(np.float32)[g_idx].T  # [out, in]
    q = np.clip(np.round(w / s) + zero[g_idx].T, 0, maxq).astype(np.int64)
    return q.T, zero, scale


def pack(vals: np.ndarray, bits: int, axis: int, order: list[int] | None = None) -> np.ndarray:
    """Unsigned values packed 32 / bits per int32 along `axis`: element p*c + order[i] at bits*i."""
    per = 32 // bits
    v = np.moveaxis(vals, axis, 0)
    order = order or list(range(per))
    words = np.zeros((v.shape[0] // per, *v.shape[1:]), np.uint64)
    for c in range(words.shape[0]):
        for i in range(per):
            words[c] |= (v[per * c + order[i]].astype(np.uint64) & ((1 << bits) - 1)) << (bits * i)
    return np.ascontiguousarray(np.moveaxis(words.astype(np.uint32).view(np.int32), 0, axis))


def make(out: str, name: str, method: str, bits: int, group: int, sym: bool, seed: int,
         desc_act: bool = False, v1: bool = True) -> str:
    from safetensors.numpy import save_file

    model = tiny("llama", seed)
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for key, w in state.items():
        if not key.endswith("_proj.weight"):
            tensors[key] = w
            continue
        module = key.removesuffix(".weight")
        n_out, n_in = w.shape
        gs = group if group > 0 else n_in
        groups = n_in // gs
        g_idx = np.arange(n_in) // gs
        if desc_act:  # inputs join groups in a random "activation" order
            g_idx = np.empty(n_in, np.int64)
            g_idx[rng.permutation(n_in)] = np.arange(n_in) // gs
        q, zero, scale = quantize(w, bits, g_idx, groups, sym)
        state[key] = ((q - zero[g_idx]) * scale.astype(np.float32)[g_idx]).T.astype(np.float32)
        tensors[f"{module}.scales"] = scale
        if method == "gptq":
            tensors[f"{module}.qweight"] = pack(q, bits, 0)
            stored_zero = (zero - 1) & ((1 << bits) - 1) if v1 else zero
            tensors[f"{module}.qzeros"] = pack(stored_zero, bits, 1)
            tensors[f"{module}.g_idx"] = g_idx.astype(np.int32)
        else:
            tensors[f"{module}.qweight"] = pack(q, 4, 1, AWQ_ORDER)
            tensors[f"{module}.qzeros"] = pack(zero, 4, 1, AWQ_ORDER)
    path = os.path.join(out, name)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "float16"  # as the hub's GPTQ / AWQ checkpoints say
    if method == "gptq":
        config["quantization_config"] = {
            "quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
            "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2", "damp_percent": 0.01,
            "true_sequential": True, "static_groups": False, "lm_head": False}
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                         "zero_point": True, "version": "gemm",
                                         "modules_to_not_convert": None}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    with open(os.path.join(path, "reference.json"), "w") as f:
        json.dump(logprobs(model), f)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"{name}: {size // 1024} KiB")
    return path


def library_reference(path: str, python: str) -> None:
    script = os.path.join(os.path.dirname(__file__), "gptq_awq_library_reference.py")
    subprocess.run([python, script, path, path + ".lib.json"], check=True)
    with open(path + ".lib.json") as f:
        lib = json.load(f)
    os.remove(path + ".lib.json")
    with open(os.path.join(path, "reference.json")) as f:
        ref = json.load(f)
    ref["library_dequantized"] = {k: lib[k] for k in ("prompt_logprobs", "library", "how")}
    ref["transformers_quantized"] = {"prompt_logprobs": lib["native_prompt_logprobs"],
                                     "library": lib["library"]}
    with open(os.path.join(path, "reference.json"), "w") as f:
        json.dump(ref, f)


def main(out: str, library_python: str | None) -> None:
    made = [make(out, "llama-gptq", "gptq", 4, 32, sym=True, seed=11),
            make(out, "llama-gptq-int8-asym", "gptq", 8, -1, sym=False, seed=12),
            make(out, "llama-gptq-actorder", "gptq", 4, 32, sym=False, seed=13, desc_act=True, v1=False),
            make(out, "llama-awq", "awq", 4, 32, sym=False, seed=14)]
    for path in made if library_python else ():
        library_reference(path, library_python)


if __name__ == "__main__":
    args = sys.argv[1:]
    lib = args[args.index("--library-reference") + 1] if "--library-reference" in args else None
    main(args[0] if args and not args[0].startswith("--") else "tests/data/quantized", lib)
