"""Export the real runner's compiled step for a GPU or TPU, on any machine, and check it is device-clean.

    python scripts/export_step.py --platform cuda|tpu [--shapes default|llama3-8b]
        [--quantization int8] [--kv-cache-dtype fp8]

Builds `ModelRunner` exactly as the worker does on that platform (its `auto` attention
backend, bfloat16), with abstract weights (nothing is allocated), and exports with
`jax.export` the forward program of the smallest and largest token buckets and the sampler
program of every mode at the largest request bucket. Fails unless, in every program:

  * the KV cache is donated and aliased to the output (updated in place, never copied);
  * no control flow can synchronise with the host outside the kernels: no `case` / `if`,
    and every `while` is a counted loop (the layer scan) whose condition compares its
    counter with a constant (kernels are opaque custom calls and are not inspected);
  * no host callback;
  * per-step inputs are one packed int32 buffer (plus arrays already on the device).

Prints one line per program. Used by tests/worker/test_export_step.py (CI runs every
platform and shape set).
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import export
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir

from jaxserve.config import KV_CACHE_DTYPES, KVCacheDtype, ParallelConfig, WeightFormat
from jaxserve.engine.resolve import AUTO_ATTENTION_BACKEND
from jaxserve.models import ArchConfig, LlamaForCausalLM
from jaxserve.models.arch_config import RopeScaling
from jaxserve.models.attention import ModelOptions
from jaxserve.parallel.mesh import make_mesh
from jaxserve.parallel.pipeline import Stage, abstract_params
from jaxserve.worker.model_runner import ModelRunner
from jaxserve.worker.penalty_state import PenaltyState
from jaxserve.worker.programs import ForwardKey, SamplerKey
from jaxserve.worker.sampler import SamplerMode
from jaxserve.worker.sampler_inputs import sampler_packing

SHAPES = {
    # SmolLM2-135M-Instruct, the default model.
    "default": ArchConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True),
    "llama3-8b": ArchConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0), max_position_embeddings=131072),
}
# Serving shapes as a GPU/TPU deployment would run them.
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN, BLOCK_SIZE, NUM_PAGES = 64, 2048, 8192, 16, 4096
DISABLED_CHECKS = {
    "cuda": [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    "tpu": [],
}


@dataclass
class Report:
    name: str
    ok: bool
    detail: str


def build_runner(
    shapes: str, platform: str, quantization: str | None = None, kv_cache_dtype: str = "auto"
) -> tuple[ModelRunner, jax.ShapeDtypeStruct]:
    """The worker's runner for `platform`, over abstract bfloat16 (or int8) weights and cache."""
    arch = SHAPES[shapes]
    model = LlamaForCausalLM(arch, ModelOptions(jnp.bfloat16, AUTO_ATTENTION_BACKEND[platform],
                                                weight_format=WeightFormat.of(quantization),
                                                kv_cache_dtype=KVCacheDtype.resolve(kv_cache_dtype, "bfloat16")))
    kv = model.kv_cache(NUM_PAGES, BLOCK_SIZE)  # the platform's layout (TPU: packed int32)
    params = abstract_params(model)
    mesh = make_mesh(ParallelConfig())
    stage = Stage(0, (0, arch.num_hidden_layers), mesh, model, params, True, True, kv)
    runner = ModelRunner([stage], max_num_seqs=MAX_NUM_SEQS,
                         max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                         max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                         max_verify_rows=MAX_NUM_SEQS * 4)  # n-gram drafts, k = 3
    return runner, kv


def _ops(op: ir.Operation):
    """Every operation nested in `op`, depth first."""
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner
                yield from _ops(inner.operation)


def _is_counted_loop(while_op: ir.Operation) -> bool:
    """The loop condition is `compare(loop argument, constant)` and nothing else."""
    cond = while_op.regions[0].blocks[0]
    ops = [op for op in cond.operations if op.operation.name != "stablehlo.constant"]
    if [op.operation.name for op in ops] != ["stablehlo.compare", "stablehlo.return"]:
        return False
    kinds = set()
    for value in ops[0].operands:
        owner = value.owner
        if isinstance(owner, ir.Block):
            kinds.add("argument")
        elif getattr(owner, "operation", owner).name == "stablehlo.constant":
            kinds.add("constant")
    return kinds == {"argument", "constant"}


def _static(value: ir.Value) -> bool:
    """Whether a case's index is known before the program runs: a constant, or the result of a
    case on such an index whose branches return constants (how an export lowers
    `lax.platform_dependent` for its one platform: resolved before XLA compiles it)."""
    owner = value.owner
    if isinstance(owner, ir.Block):
        return False
    op = getattr(owner, "operation", owner)
    if op.name == "stablehlo.constant":
        return True
    if op.name != "stablehlo.case" or not _static(op.operands[0]):
        return False
    for region in op.regions:
        ret = list(region.blocks[0].operations)[-1]
        if not all(_static(v) for v in ret.operands):
            return False
    return True


def check_program(exported: export.Exported, donated_type: str | None) -> list[str]:
    """Problems found in an exported program (empty when device-clean)."""
    text = exported.mlir_module()
    problems = []
    if donated_type is not None:
        aliased = re.search(re.escape(donated_type) + r"\s*\{[^}]*tf\.aliasing_output", text)
        if not aliased:
            problems.append(f"the KV cache ({donated_type}) is not aliased to an output")
    with jax_mlir.make_ir_context() as ctx:
        module = ir.Module.parse(text, context=ctx)
        for op in _ops(module.operation):
            name = op.operation.name
            if name in ("stablehlo.case", "stablehlo.if") and not _static(op.operation.operands[0]):
                problems.append(f"data-dependent {name}")
            elif name == "stablehlo.while" and not _is_counted_loop(op.operation):
                problems.append("a while loop whose trip count is data")
            elif name == "stablehlo.custom_call":
                target = str(op.operation.attributes["call_target_name"])
                if "callback" in target:
                    problems.append(f"host callback {target}")
    return problems


def export_step(
    shapes: str, platform: str, quantization: str | None = None, kv_cache_dtype: str = "auto"
) -> list[Report]:
    runner, kv = build_runner(shapes, platform, quantization, kv_cache_dtype)
    stage = runner.stages[0]
    S, H = MAX_NUM_SEQS, stage.model.cfg.hidden_size
    element = {"uint8": "ui8", "int32": "i32", "bfloat16": "bf16"}[jnp.dtype(kv.dtype).name]
    kv_type = "tensor<" + "x".join(map(str, kv.shape)) + f"x{element}>"
    last_sampled = jax.ShapeDtypeStruct((S,), jnp.int32)
    reports = []
    forward = jax.jit(runner.stage_fn, static_argnums=(0,), donate_argnums=(2,))
    for T in (runner.token_buckets[0], runner.token_buckets[-1]):
        buf = jax.ShapeDtypeStruct((runner.forward_packing(T).size,), jnp.int32)
        exp = export.export(forward, platforms=[platform], disabled_checks=DISABLED_CHECKS[platform])(
            ForwardKey(0, T), stage.params, kv, last_sampled, buf)
        problems = check_program(exp, kv_type)
        # Inputs besides the weights: the cache and last_sampled (both on the device) and
        # the step's one packed buffer.
        extra = len(exp.in_avals) - len(jax.tree.leaves(stage.params))
        if extra != 3:
            problems.append(f"{extra} inputs besides the weights, expected 3")
        reports.append(Report(f"forward[T={T}]", not problems,
                              "; ".join(problems) or "cache aliased, no host sync, 1 upload"))
    hidden = jax.ShapeDtypeStruct((runner.num_logit_rows, H), jnp.bfloat16)
    penalties = jax.eval_shape(lambda: runner.penalties)
    assert isinstance(penalties, PenaltyState)
    sample = jax.jit(runner.sample_fn, static_argnums=(0,), donate_argnums=(3, 4))
    # verify: speculative decoding's rejection sampler (its row buckets, when configured).
    programs = [(runner.request_buckets[-1], False)]
    if runner.verify_buckets:
        programs.append((runner.verify_buckets[-1], True))
    for (R, verify), mode, proc in itertools.product(programs, SamplerMode, (False, True)):
        buf = jax.ShapeDtypeStruct((sampler_packing(R, verify).size,), jnp.int32)
        exp = export.export(sample, platforms=[platform], disabled_checks=DISABLED_CHECKS[platform])(
            SamplerKey(R, mode, verify, proc), stage.params, hidden, last_sampled, penalties, buf)
        problems = check_program(exp, None)
        name = "verify" if verify else "sample"
        tag = ", processors" if proc else ""
        reports.append(Report(f"{name}[R={R}, {mode.value}{tag}]", not problems,
                              "; ".join(problems) or "no host sync, 1 upload"))
    return reports


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--platform", choices=sorted(DISABLED_CHECKS), required=True)
    p.add_argument("--shapes", choices=sorted(SHAPES), default="default")
    p.add_argument("--quantization", choices=["int8", "bf16"], default=None)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    args = p.parse_args(argv)
    reports = export_step(args.shapes, args.platform, args.quantization, args.kv_cache_dtype)
    for r in reports:
        print(f"{'ok  ' if r.ok else 'FAIL'} {args.platform} {args.shapes} {r.name}: {r.detail}")
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
