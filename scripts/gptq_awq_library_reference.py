#!/usr/bin/env python
"""External-library reference for GPTQ / AWQ(GEMM) checkpoints, CPU only.

    python3.11 -m venv /tmp/gptq-venv
    /tmp/gptq-venv/bin/pip install torch==2.13.0 "gptqmodel==7.6.0" optimum   # torch's CPU wheel
    /tmp/gptq-venv/bin/python scripts/gptq_awq_library_reference.py <checkpoint_dir> <out.json>

(gptqmodel 7.6.0 is pure Python from its sdist; 7.7 needs torch >= 2.14.1.)
scripts/make_gptq_awq_checkpoints.py --library-reference records its output in each
checkpoint's reference.json.

The checkpoint is loaded by transformers' own quantizer integration
(GPTQ: transformers GptqHfQuantizer -> optimum.gptq -> gptqmodel TorchLinear;
 AWQ: transformers AwqQuantizer -> gptqmodel AwqTorchLinear), i.e. none of
jaxserve's code touches the packed tensors.  Two sets of numbers are produced:

* prompt_logprobs (the reference): every quantized linear is dequantized by
  the library's own dequant routine with its scales promoted to float32
  (GPTQ: gptqmodel TorchLinear.dequantize_weight(), after the library's
  v1->v2 qzeros conversion; AWQ: gptqmodel
  quantization.awq.utils.packing_utils.dequantize_gemm), swapped for a dense
  float32 nn.Linear, and the whole model is run in float32.
* native_prompt_logprobs: the same loaded model run through the library's
  own CPU kernels before the swap (GPTQ TorchLinear multiplies with weights
  dequantized in the fp16 scale dtype; AWQ AwqTorchLinear computes in fp16),
  kept as a cross-check; native_vs_reference_max_abs_diff reports the gap.
"""
import json
import os
import sys

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # gptqmodel's default pool asserts on 2-core boxes
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

PROMPT = list(range(3, 40))


def prompt_logprobs(model):
    ids = torch.tensor([PROMPT], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].to(torch.float32)
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i, PROMPT[i + 1]]) for i in range(len(PROMPT) - 1)]


def dense_from_quant(mod, method):
    """Dense float32 [out, in] weight from a loaded gptqmodel quant linear, via library code."""
    if method == "gptq":
        # TorchLinear: qzeros were already converted v1 -> v2 (+1) by the library at load time.
        mod.scales = mod.scales.to(torch.float32)
        mod.train(False)
        w = mod.dequantize_weight()  # [in, out] = scales[g_idx] * (q - z)
    else:
        from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

        w = dequantize_gemm(
            qweight=mod.qweight,
            qzeros=mod.qzeros,
            scales=mod.scales.to(torch.float32),
            bits=mod.bits,
            group_size=mod.group_size,
        )  # [in, out] = (q - z) * s
    w = w.to(torch.float32)
    assert tuple(w.shape) == (mod.in_features, mod.out_features), (w.shape, mod.in_features, mod.out_features)
    return w.t().contiguous()


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    ckpt, out_path = sys.argv[1], sys.argv[2]

    import importlib.metadata as md

    import gptqmodel
    import transformers
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from transformers import AutoModelForCausalLM, AwqConfig, GPTQConfig

    with open(os.path.join(ckpt, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    method = qc["quant_method"].lower()
    # Only the kernel choice is overridden; transformers merges the rest of
    # the quantization config from the checkpoint's config.json.
    if method == "gptq":
        override = GPTQConfig(bits=qc["bits"], backend="torch")  # gptqmodel TorchLinear (pure torch)
    elif method == "awq":
        override = AwqConfig(bits=qc["bits"], backend="torch_awq")  # gptqmodel AwqTorchLinear (pure torch)
    else:
        sys.exit(f"unsupported quant_method {method!r}")

    model = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, device_map="cpu", quantization_config=override
    )
    model.eval()

    qmods = [(n, m) for n, m in model.named_modules() if isinstance(m, BaseQuantLinear)]
    if not qmods:
        sys.exit("no quantized modules were created by the library")
    kernel = sorted({type(m).__name__ for _, m in qmods})

    native = prompt_logprobs(model)

    # swap every quant linear for a dense float32 Linear built from the library's dequant
    for name, mod in qmods:
        w = dense_from_quant(mod, method)
        lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, dtype=torch.float32)
        with torch.no_grad():
            lin.weight.copy_(w)
            if mod.bias is not None:
                lin.bias.copy_(mod.bias.to(torch.float32))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, lin)
    # everything else (embeddings, norms, lm_head, rotary) must already be float32
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point() and t.dtype != torch.float32:
                t.data = t.data.to(torch.float32)
    ref = prompt_logprobs(model)

    libs = (
        f"gptqmodel {gptqmodel.__version__}; transformers {transformers.__version__}; "
        f"optimum {md.version('optimum')}; torch {torch.__version__}"
    )
    how = (
        f"transformers AutoModelForCausalLM.from_pretrained(dtype=float32, device_map=cpu) with the checkpoint's "
        f"{method} quantization_config (kernel override backend="
        f"{'torch' if method == 'gptq' else 'torch_awq'} -> {','.join(kernel)}); "
        + (
            "library v1->v2 qzeros conversion at load, then TorchLinear.dequantize_weight() with fp32 scales"
            if method == "gptq"
            else "then gptqmodel packing_utils.dequantize_gemm() with fp32 scales"
        )
        + f" for {len(qmods)} linears swapped into dense fp32 nn.Linear; full fp32 forward on PROMPT=range(3,40)"
    )
    out = {
        "prompt_logprobs": ref,
        "library": libs,
        "how": how,
        "quant_method": method,
        "native_prompt_logprobs": native,
        "native_vs_reference_max_abs_diff": max(abs(a - b) for a, b in zip(native, ref)),
    }
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if "logprobs" not in k}, indent=1))
    print("first logprobs:", ref[:4])


if __name__ == "__main__":
    main()
