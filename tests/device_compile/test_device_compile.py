"""Compile, not export, for real TPUs and GPUs, on a machine with neither.

libtpu's compile-only TPU topologies and the CUDA plugin's compile-only devices (from XLA's
target specs, jaxserve/worker/gpu_targets/) run the device compilers themselves: Mosaic for the
TPU kernels, Triton and ptxas for the GPU ones, XLA's TPU / GPU pipelines for the rest. Every
program the engine runs (jaxserve/worker/programs.py: each forward bucket, every sampler mode
and bucket, the verification sampler, the prompt-logprob and grammar variants) must compile
with the platform's own kernel, update the KV cache in place (aliased, never copied or
relaid out), and, on GPUs, spill no registers. The engine configs here are small (few buckets:
compile time is CPU time in CI); the program table is the one any config has.

Needs the preflight extra (`pip install -e '.[preflight]'`, which scripts/test.sh installs);
without it these tests skip, unless JAXSERVE_REQUIRE_DEVICE_COMPILE=1 (CI) makes that a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from jaxserve.worker.targets import parse_target

_MISSING = [m for m in ("libtpu", "jax_plugins.xla_cuda12") if importlib.util.find_spec(m) is None]
if _MISSING and os.environ.get("JAXSERVE_REQUIRE_DEVICE_COMPILE") == "1":
    raise RuntimeError(f"device-compile tests need {', '.join(_MISSING)}: "
                       "pip install -e '.[preflight]'")
pytestmark = pytest.mark.skipif(bool(_MISSING), reason="needs pip install -e '.[preflight]'")

# One bucket of each kind (T=16 tokens, R=1 sequence): the program table is the one any config
# has, and more buckets are the same code at other shapes (compile time is CI's time).
SMALL = ["--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--max-model-len", "2048"]
RESULTS = os.environ.get("JAXSERVE_DEVICE_COMPILE_RESULTS")  # a JSON-lines file, if set


def _preflight(target: str, *flags: str) -> SimpleNamespace:
    """`python -m jaxserve.preflight --json` as a user runs it: one process per target (libtpu
    keeps per-process state, and a compiler crash must not take the test run with it)."""
    cmd = [sys.executable, "-m", "jaxserve.preflight", "--target", target, "--json",
           "--compile-threads", "2", *SMALL, *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode in (0, 1), f"{' '.join(cmd)}: rc {proc.returncode}\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout)
    assert report["ok"] == (proc.returncode == 0)
    if RESULTS:
        with open(RESULTS, "a") as f:
            f.write(json.dumps({"flags": flags, **report}) + "\n")
    programs = [SimpleNamespace(**p) for p in report.pop("programs")]
    memory = SimpleNamespace(**report.pop("memory")) if report["memory"] else None
    return SimpleNamespace(**{**report, "programs": programs, "memory": memory,
                              "stderr": proc.stderr})


def _assert_clean(report) -> None:
    assert report.memory is not None, report.error
    bad = [f"{p.name}: {p.error}" for p in report.programs if p.error]
    assert not bad, "\n".join(bad)
    assert report.ok, report.error
    forwards = [p for p in report.programs if p.kind == "forward"]
    assert forwards and all(p.alias_bytes >= report.memory.kv_cache_bytes for p in forwards)


# Pages given: no sizing compiles, for the tests about what compiles rather than what fits.
FIXED_CACHE = ["--num-gpu-blocks-override", "512"]
# The default model's decode steps on v5e:2x2 -tp 2 read 4.5x (batch 1) and 5.0x (batch 2) the
# ideal bytes as XLA counts them, mostly on-chip prefetches counted on both sides
# (docs/benchmarks.md, "Compiled bytes against the ideal"): a ratchet, not the 1.25x,
# which test_llama3_8b_decode_reads_near_the_ideal holds at 8B shapes.
BYTES_OVER_IDEAL_V5E_TP2 = 5.25
SPEC = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 1}']
WARM_UP = ["--only-warm-up"]  # the first-use variants (grammar, prompt logprobs, pooling) on v6e


@pytest.mark.parametrize("target,flags", [
    ("v6e:1x1", []), ("v5e:1x1", [*SPEC, *WARM_UP, "--programs", "forward,verify,admit"]),
    # A fixed cache on tpu7x: its forward's temp grows with the cache (80 B a page, 16 MB at
    # the 188,192 pages 96 GiB holds here; docs/benchmarks.md), which is not the weight copy
    # the temp bound below guards against.
    ("tpu7x:1x1", [*WARM_UP, "--programs", "forward,admit", *FIXED_CACHE]),
    # One H100 alone is h200's compile (both sm_90): h100 runs tensor-parallel only, for CI's
    # time (the GPU forward is unrolled: about 3x the compile of a scanned one).
    # The first-use variants (grammar samplers, prompt logprobs, pooling) are XLA's own ops
    # on every platform: v6e compiles them; on h200 they doubled the case (to 144 s).
    ("v5e:2x2", ["-tp", "4", *WARM_UP]), ("h200", [*SPEC, *WARM_UP]), ("h100", ["-tp", "2", *WARM_UP]),
], ids=lambda v: v if isinstance(v, str) else " ".join(a for a in v if a.startswith("-")) or "all")
def test_every_engine_program_compiles(target: str, flags: list[str]) -> None:
    """The default model (bf16, the platform's own attention kernel), every program the
    engine runs (with speculative decoding on one TPU and one GPU: the verification sampler's
    programs too). CI's time bounds the targets that also compile the first-use variants."""
    report = _preflight(target, *flags)
    _assert_clean(report)
    kinds = {p.kind for p in report.programs}
    first_use = "--only-warm-up" not in flags
    wanted = {"forward", "sample", "admit"} | ({"verify"} if SPEC[0] in flags else set()) | (
        {"prompt_logprobs", "pool"} if first_use else set())
    if "--programs" in flags:  # CI's time: the samplers are compiled for v6e, v5e:2x2, GPUs
        wanted &= set(flags[flags.index("--programs") + 1].split(","))
    assert kinds == wanted
    assert any(not p.at_warm_up for p in report.programs) == first_use
    assert report.settings["attention_backend"] == ("tpu" if target[0] in "vt" else "gpu")
    assert report.memory.num_pages > 1 and report.compile_s["total"] > 0
    # Start-up's counts (issue 75): the sizing compiles, unless the pages are given, then all.
    assert ("Sizing the KV cache: " in report.stderr) == (FIXED_CACHE[0] not in flags)
    n = len(report.programs)
    assert f"Compiling programs for {target}: {n}/{n} in " in report.stderr
    if target.startswith(("v6e", "tpu7x", "h100", "h200")):
        # No copy of the weights (tpu7x copied every layer stack at each step, 241 MiB of temp:
        # jaxserve/parallel/sharding.py, WEIGHT_TILINGS; CUDA's loop copied each layer's slice
        # before its GEMMs: ModelOptions.scan_unroll): a forward's temp is its activations,
        # a sliver of the weights.
        temp = {p.name: p.temp_bytes for p in report.programs if p.kind == "forward"
                # GPU: at decode batch 16 (the bound; an unrolled forward at 32 tokens
                # holds 5.6 MB of activations, 2.1% of this 269 MB model)
                and (target[0] in "vt" or p.name.startswith("forward[T=16"))}
        assert max(temp.values()) <= 0.02 * report.memory.weight_bytes, temp


@pytest.mark.parametrize("target,variant", [
    ("v6e:1x1", ["--kv-cache-dtype", "fp8", "--programs", "forward"]),
    ("h200", ["--kv-cache-dtype", "fp8", "--programs", "forward"]),
    ("v6e:1x1", ["--quantization", "int8", "--programs", "forward"]),
    ("h200", ["--quantization", "int8", "--programs", "forward,sample"]),
    ("v6e:1x1", ["--quantization", "bf16", "--programs", "forward"]),
], ids=["fp8-kv-v6e", "fp8-kv-h200", "int8-v6e", "int8-h200", "bf16-v6e"])
def test_variants_users_pick_compile(target: str, variant: list[str]) -> None:
    """An fp8 KV cache changes the forward; int8 weights the forward and the samplers'
    LM head; bf16 weights (the CPU's kernels off the CPU: XLA's reference) the forward."""
    _assert_clean(_preflight(target, "--only-warm-up", *variant, *FIXED_CACHE))


@pytest.fixture(scope="module")
def sliding_window_model(tmp_path_factory) -> str:
    """A Mistral-shaped config.json with a sliding window (no weights: preflight needs none)."""
    import transformers

    path = str(tmp_path_factory.mktemp("mistral"))
    transformers.MistralConfig(architectures=["MistralForCausalLM"], vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                               num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                               head_dim=64, sliding_window=256,
                               max_position_embeddings=4096).save_pretrained(path)
    return path


@pytest.mark.parametrize("target", ["v5e:1x1", "h100"])
def test_sliding_window_model_compiles(target: str, sliding_window_model: str) -> None:
    report = _preflight(target, "--model", sliding_window_model, "--programs", "forward",
                        "--only-warm-up", *FIXED_CACHE)
    _assert_clean(report)


LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
    max_position_embeddings=8192, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def _save_llama(path: str, **overrides) -> str:
    import transformers

    transformers.LlamaConfig(**{**LLAMA3_8B, **overrides}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama3_8b(tmp_path_factory) -> str:
    return _save_llama(str(tmp_path_factory.mktemp("llama3-8b")))


@pytest.fixture(scope="module")
def llama3_8b_8_layers(tmp_path_factory) -> str:
    """Llama-3-8B's shapes with a quarter of its layers: every layer is the same program, and the
    roofline's unrolled copy compiles in about a quarter of the time (CI's time)."""
    return _save_llama(str(tmp_path_factory.mktemp("llama3-8b-8-layers")), num_hidden_layers=8)


def test_llama3_8b_on_one_v5e_is_refused_before_compiling(llama3_8b: str) -> None:
    report = _preflight("v5e:1x1", "--model", llama3_8b)
    assert not report.ok and not report.programs  # nothing compiled
    assert report.error.startswith("kv_cache_manager: no room for a KV cache on TPU v5 lite")
    for knob in ("--tensor-parallel-size", "--quantization", "--max-model-len",
                 "--gpu-memory-utilization"):
        assert knob in report.error
    assert "14.96 GiB per device" in report.error  # 8.03B bf16 weights
    assert "a cache of 128.00 KiB per token" in report.error


def test_llama3_8b_with_tensor_parallelism_fits_v5e_2x2(llama3_8b: str) -> None:
    """Sized from the compiler, weights a quarter per device; the forward compiles with the
    TPU kernel under shard_map over 4 chips, the cache in place."""
    report = _preflight("v5e:2x2", "--model", llama3_8b, "-tp", "4", "--programs", "forward",
                        "--only-warm-up")
    _assert_clean(report)
    m = report.memory
    assert 3.7 * 2**30 < m.weight_bytes < 3.9 * 2**30
    assert m.max_concurrent_seqs >= 1 and m.kv_bytes_per_token == 32 * 2 * 2 * 128 * 2  # 2 of 8 heads


# Issue 47: Llama-3-8B as the FP8 (per channel) and W4A16 (group 128) checkpoints users
# download, from config.json alone: the stored width counts (embedding and LM head bf16, as
# stored) and the forward compiles with the scaled-weight kernels (kernels_pallas/int8_matmul).
QUANTIZED_8B = {"fp8": ("llama-fp8-dynamic", None), "w4a16": ("llama-w4a16", 128),
                "awq": ("llama-awq", 128), "gptq-actorder": ("llama-gptq-actorder", 128)}


@pytest.mark.parametrize("scheme,target,bits", [
    ("fp8", "v5e:1x1", 8), ("w4a16", "v5e:1x1", 4), ("fp8", "v6e:1x1", 8), ("fp8", "tpu7x:1x1", 8),
    ("w4a16", "h100", 4),  # the GPU kernel reads int4 as bytes, two values each
    ("awq", "v5e:1x1", 4),  # zero points: int4 values and a zero_scale leaf
    ("gptq-actorder", "v5e:1x1", 4)])  # zero points and inputs permuted into their groups
def test_quantized_llama3_8b_keeps_its_stored_width(scheme: str, target: str, bits: int,
                                                    llama3_8b: str, tmp_path) -> None:
    import shutil

    data = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "quantized")
    name, group = QUANTIZED_8B[scheme]
    with open(os.path.join(data, name, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    if group:
        (qc["config_groups"]["group_0"]["weights"] if "config_groups" in qc else qc)["group_size"] = group
    shutil.copy(os.path.join(llama3_8b, "config.json"), tmp_path / "config.json")
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**cfg, "tie_word_embeddings": False, "quantization_config": qc}, f)
    # The cache sized from the compiler once (fp8 on v5e: the widest that must fit), given
    # elsewhere: sizing compiles the forward again at its probe shapes (CI's time).
    sized = (scheme, target) == ("fp8", "v5e:1x1")
    report = _preflight(target, "--model", str(tmp_path), "--programs", "forward", *WARM_UP,
                        *([] if sized else FIXED_CACHE))
    _assert_clean(report)
    # The values are read in place: no widened copy of a layer (112 MiB for gate_proj in bf16).
    assert max(p.temp_bytes for p in report.programs) < 64 << 20
    projections = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336)
    stored = projections * bits // 8 + 2 * 128256 * 4096 * 2
    if scheme in ("awq", "gptq-actorder"):  # fp16 scales and 4-bit zero points per group of 128
        stored += projections * (2 + 0.5) // 128
    assert stored <= report.memory.weight_bytes <= 1.05 * stored
    if sized:  # the bf16 checkpoint does not fit (the test above); 4-bit ones hold more
        assert report.memory.max_concurrent_seqs >= 16


@pytest.mark.parametrize("target", ["v6e:1x1", "tpu7x:1x1"])
def test_llama3_8b_decode_reads_near_the_ideal(target: str, llama3_8b_8_layers: str) -> None:
    """Issue 45's bound at 8B shapes (8 of the 32 layers), decode batch 16 at 1k: the compiled
    step (an unrolled copy of the forward, the kernel's plan, the greedy sampler) reads at most
    1.25x the ideal bytes, and the scanned forward's temp is at most 2% of the weights (tpu7x
    once copied the whole layer stack each step: 3.4 GiB at 8 layers). Only the programs those
    take are compiled (CI's time)."""
    from jaxserve.preflight import make_parser, run_preflight, validate
    from jaxserve.worker.programs import ProgramKind, SamplerKey
    from jaxserve.worker.sampler import SamplerMode

    args = make_parser().parse_args([
        "--model", llama3_8b_8_layers, "--target", target, "--max-num-seqs", "16",
        "--max-num-batched-tokens", "16", "--max-model-len", "1024",
        "--num-gpu-blocks-override", "1024"])
    targets, config, files, _ = validate(args)
    greedy = SamplerKey(16, SamplerMode.GREEDY, verify=False, processors=False)
    report = run_preflight(config, targets[0], files, on_first_use=False, roofline=True,
                           only=lambda p: p.kind is ProgramKind.FORWARD or p.key == greedy)
    names = [p.name for p in report.programs]
    assert report.ok and names == ["forward[T=16]", "sample[R=16, greedy]"], (
        report.error, [p.error for p in report.programs])
    row = next(r for r in report.roofline
               if (r.program, r.batch, r.context) == ("decode", 16, 1024))
    print(f"{target} 8B decode 16 x 1k: compiled / ideal bytes "
          f"{row.compiled_bytes / row.ideal_bytes:.3f}, forward temp "
          f"{row.temp_bytes / 2**20:.1f} MiB, sampler share {row.sampler_share:.2%}")
    assert row.compiled_bytes / row.ideal_bytes <= 1.25  # today 1.04 on both (1.03 at 32 layers)
    assert row.temp_bytes <= 0.02 * report.memory.weight_bytes  # today 1.2 / 65.4 MiB of 5.2 GiB
    assert row.sampler_share <= 0.05  # today 2.8% (0.8% at 32 layers: the sampler is per step)


def test_attention_kernels_compile_per_generation() -> None:
    """The TPU kernel and KV write, alone, over the packed cache, for every generation, value
    type and option (soft cap has no model here yet), at Llama-3-8B and default-model head
    shapes: compiled with no copy of the cache and the cache aliased."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import kernels_pallas
    from jaxserve.worker.programs import Program, compile_program, without_persistent_cache
    from jaxserve.worker.targets import make_devices

    with without_persistent_cache():
        failures = []
        for gen in ("v5e:1x1", "v6e:1x1", "tpu7x:1x1"):
            mesh = Mesh(np.array(make_devices(parse_target(gen), 1)), ("x",))
            rep = NamedSharding(mesh, PartitionSpec())
            for (hq, hkv, d), dtype, opts in [
                ((32, 8, 128), "bfloat16", {}), ((32, 8, 128), "fp8", {"soft_cap": 30.0}),
                ((9, 3, 64), "bfloat16", {"sliding_window": 64}), ((9, 3, 64), "fp8_e5m2", {}),
                ((8, 1, 128), "float32", {"soft_cap": 50.0, "sliding_window": 100}),
            ]:
                layout = kernels_pallas.kv_cache_layout(hkv, d, dtype, platform="tpu")

                def step(cache, q, k, v, slots, kv_lens, pages, cu, n, layout=layout, opts=opts):
                    cache = kernels_pallas.update_kv_cache(cache, k, v, slots, backend="tpu",
                                                           layout=layout)
                    spec = kernels_pallas.AttentionSpec(sm_scale=d ** -0.5, layout=layout, **opts)
                    return kernels_pallas.ragged_paged_attention(
                        q, cache, kv_lens, pages, cu, n, spec=spec, backend="tpu"), cache

                a = lambda s, t=jnp.int32: jax.ShapeDtypeStruct(s, t, sharding=rep)  # noqa: E731
                bf = jnp.bfloat16 if dtype != "float32" else jnp.float32
                cache = a(layout.cache_shape(1024, 16), layout.storage_dtype)
                args = (cache, a((64, hq, d), bf), a((64, hkv, d), bf), a((64, hkv, d), bf),
                        a((64,)), a((16,)), a((16, 64)), a((17,)), a((1,)))
                fn = jax.jit(step, donate_argnums=0)
                try:
                    c, _ = compile_program(Program(f"{gen} {dtype} {opts}", "forward", fn, args,
                                                   mesh, cache_arg=0))
                    failures += [f"{c.name}: {p}" for p in c.problems()]
                except Exception as e:  # noqa: BLE001
                    failures.append(f"{gen} {dtype} {opts}: {' '.join(str(e).split())[:300]}")
    assert not failures, "\n".join(failures)


def test_gpu_register_spills_fail_the_compile() -> None:
    """With the preflight's GPU options a tuning that spills (docs/gpu_tunings.md: 128 q rows x
    128 keys on 4 warps, 1,544 B) fails to compile, and the default tuning compiles."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from jaxserve.preflight import GPU_COMPILER_OPTIONS
    from jaxserve.worker.programs import without_persistent_cache
    from jaxserve.worker.targets import make_devices
    from kernels_pallas import AttentionSpec
    from kernels_pallas.ragged_paged_attention import gpu

    on = SingleDeviceSharding(make_devices(parse_target("h200"), 1)[0])
    a = lambda s, t=jnp.int32: jax.ShapeDtypeStruct(s, t, sharding=on)  # noqa: E731
    args = (a((256, 32, 128), jnp.bfloat16), a((4096, 16, 16, 128), jnp.bfloat16), a((64,)),
            a((64, 512)), a((65,)), a((1,)))

    def compile_with(**tuning):
        fn = jax.jit(lambda *x: gpu.ragged_paged_attention(
            *x, spec=AttentionSpec(sm_scale=0.1), tuning=gpu.GpuTuning(**tuning)))
        return fn.trace(*args).lower().compile(GPU_COMPILER_OPTIONS)

    with without_persistent_cache():  # compile-only executables cannot be read back
        compile_with()  # the default tuning
        with pytest.raises(Exception, match="register spilling"):
            compile_with(block_q=32, pages_per_block=8, num_warps=4)


def test_head_dim_256_sliding_window_over_a_large_cache_compiles_for_h100() -> None:
    """Issue 50's Gemma-3-4B at 32k on an H100 (8 q heads, 4 KV heads of 256, window 1,024, a
    cache of 21,714 pages past 2^31 elements, so 64-bit slot offsets): the default tuning
    spilled registers with a sliding window (the preflight failed) and compiles now."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from jaxserve.preflight import GPU_COMPILER_OPTIONS
    from jaxserve.worker.programs import without_persistent_cache
    from jaxserve.worker.targets import make_devices
    from kernels_pallas import AttentionSpec
    from kernels_pallas.ragged_paged_attention import gpu

    on = SingleDeviceSharding(make_devices(parse_target("h100"), 1)[0])
    a = lambda s, t=jnp.int32: jax.ShapeDtypeStruct(s, t, sharding=on)  # noqa: E731
    args = (a((512, 8, 256), jnp.bfloat16), a((69666, 16, 8, 256), jnp.bfloat16), a((64,)),
            a((64, 2048)), a((65,)), a((1,)))
    with without_persistent_cache():
        for window in (1024, None):
            spec = AttentionSpec(sm_scale=0.0625, sliding_window=window)
            fn = jax.jit(lambda *x, spec=spec: gpu.ragged_paged_attention(*x, spec=spec))
            fn.trace(*args).lower().compile(GPU_COMPILER_OPTIONS)
        with pytest.raises(Exception, match="register spilling"):  # the former default
            fn = jax.jit(lambda *x: gpu.ragged_paged_attention(
                *x, spec=AttentionSpec(sm_scale=0.0625, sliding_window=1024),
                tuning=gpu.GpuTuning(block_q=16, pages_per_block=2)))
            fn.trace(*args).lower().compile(GPU_COMPILER_OPTIONS)


def _save_qwen3_moe(path: str, **extra) -> str:
    """A Qwen3-MoE-shaped config.json (64 experts, top-8; no weights: preflight needs none)."""
    import transformers

    transformers.Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=32000, hidden_size=1024,
        intermediate_size=3072, moe_intermediate_size=256, num_experts=64,
        num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
        **extra).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3_moe_model(tmp_path_factory) -> str:
    return _save_qwen3_moe(str(tmp_path_factory.mktemp("qwen3-moe")))


@pytest.mark.parametrize("target,flags", [
    ("v5e:1x1", []), ("h200", []), ("v5e:2x2", ["-tp", "4", "--enable-expert-parallel"]),
    ("h200", ["--quantization", "int8"]),
], ids=["v5e", "h200", "v5e-ep4", "h200-int8"])
def test_mixture_of_experts_compiles(target: str, flags: list[str], qwen3_moe_model: str) -> None:
    """The experts' grouped matmuls (ragged_dot) and, with expert parallelism, their
    shard_map over 4 chips, through each device compiler."""
    report = _preflight(target, "--model", qwen3_moe_model, "--programs", "forward",
                        "--only-warm-up", *FIXED_CACHE, *flags)
    _assert_clean(report)
    if "-tp" in flags:  # a quarter of the 384 MiB of bf16 experts per chip, beside the rest
        experts = 4 * 3 * 64 * 1024 * 256 * 2
        assert experts / 4 < report.memory.weight_bytes < experts / 4 + 40 * 2**20


@pytest.fixture(scope="module")
def qwen3_moe_mixed_model(tmp_path_factory) -> str:
    """The Qwen3-MoE shape with every other layer dense (decoder_sparse_step 2)."""
    return _save_qwen3_moe(str(tmp_path_factory.mktemp("qwen3-moe-mixed")), decoder_sparse_step=2)


@pytest.mark.parametrize("target,flags", [
    ("h200", []), ("v5e:2x2", ["-tp", "4", "--enable-expert-parallel"]),
], ids=["h200", "v5e-ep4"])
def test_dense_layers_among_the_sparse_compile(target: str, flags: list[str],
                                               qwen3_moe_mixed_model: str) -> None:
    """Each layer's branch (experts or dense MLP, a cond on the layer index) over whole
    stacks of each kind, through each device compiler; with expert parallelism, the experts'
    shard_map inside the branch."""
    report = _preflight(target, "--model", qwen3_moe_mixed_model, "--programs", "forward",
                        "--only-warm-up", *FIXED_CACHE, *flags)
    _assert_clean(report)


@pytest.fixture(scope="module")
def gemma3_model(tmp_path_factory) -> str:
    """A Gemma-3-1B-shaped config.json: 5 sliding layers to 1 full, soft caps off, q/k norms."""
    import transformers

    path = str(tmp_path_factory.mktemp("gemma3"))
    transformers.Gemma3TextConfig(
        architectures=["Gemma3ForCausalLM"], vocab_size=32000, hidden_size=1152,
        intermediate_size=6912, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512,
        max_position_embeddings=4096).save_pretrained(path)
    return path


@pytest.mark.parametrize("target", ["v5e:1x1", "h200"])
def test_gemma3_compiles(target: str, gemma3_model: str) -> None:
    """Sliding and full layers in one scan (a cond per layer, two attention plans, a block
    table per KV cache group) through each device compiler, with the platform's kernel."""
    report = _preflight(target, "--model", gemma3_model, "--programs", "forward",
                        "--only-warm-up", *FIXED_CACHE)
    _assert_clean(report)
    # KV cache groups: the full layer's and five sliding ones of one layer each, whose pages
    # per sequence are the window's.
    groups = report.memory.kv_cache_groups
    assert [g["pages_per_seq"] for g in groups] == [128] + [33] * 5, groups
    assert report.memory.max_concurrent_seqs > report.memory.max_concurrent_seqs_every_page_kept


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory) -> str:
    """A GPT-OSS-shaped config.json: GPT-OSS-20B's attention (64 q heads over 8 KV heads of 64,
    a 128-token window on every other layer, sinks) and biased experts, fewer and smaller."""
    import transformers

    path = str(tmp_path_factory.mktemp("gpt-oss"))
    transformers.GptOssConfig(
        architectures=["GptOssForCausalLM"], vocab_size=32000, hidden_size=1024,
        intermediate_size=1024, num_hidden_layers=4, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=8, num_experts_per_tok=4,
        sliding_window=128, max_position_embeddings=4096,
        quantization_config={"quant_method": "mxfp4"}).save_pretrained(path)
    return path


@pytest.mark.parametrize("target", ["h100", "tpu7x:1x1"])
def test_gpt_oss_compiles(target: str, gpt_oss_model: str) -> None:
    """Attention sinks in the GPU (Triton) and TPU (Mosaic) kernels, beside a window (on an
    H100 the windowed kernel at GPT-OSS's heads spilled registers at 4 warps), and MXFP4
    experts kept at 4 bits: 4 x 8 x 3 x 1024^2 values, half a byte each with a float32 scale
    per 32, beside 206 MB of bf16 embeddings and attention (bf16 experts: 406 MB)."""
    report = _preflight(target, "--model", gpt_oss_model, "--programs", "forward",
                        "--only-warm-up", *FIXED_CACHE)
    _assert_clean(report)
    assert [g["pages_per_seq"] for g in report.memory.kv_cache_groups] == [128, 9]
    assert report.memory.weight_bytes < 300 * 2**20


@pytest.fixture(scope="module")
def gdn_hybrid(tmp_path_factory) -> str:
    """A small Qwen3-Next (3 Gated DeltaNet layers, then a full one; routed experts with a
    shared one, layer 1 dense) at the released models' head dims: at the tiny test
    checkpoints' 8 x 8 states v6e relayouts the state pool around its scatter (two copies a
    step), at 128 x 128 it does not."""
    import transformers

    path = str(tmp_path_factory.mktemp("qwen3_next"))
    transformers.Qwen3NextConfig(
        architectures=["Qwen3NextForCausalLM"], vocab_size=1024, hidden_size=256,
        intermediate_size=512, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, shared_expert_intermediate_size=128, mlp_only_layers=[1],
        max_position_embeddings=2048).save_pretrained(path)
    return path


@pytest.mark.parametrize("target", ["v6e:1x1", "h100"])
def test_gated_deltanet_hybrid_compiles(target: str, gdn_hybrid: str) -> None:
    """The hybrid's forward (the delta rule token by token up to 64 tokens, chunked at the
    128-token bucket) with its state pool donated and written in place; the pool's slots and
    bytes in the memory report."""
    report = _preflight(target, "--model", gdn_hybrid, "--programs", "forward",
                        "--max-num-batched-tokens", "128", *WARM_UP, *FIXED_CACHE)
    _assert_clean(report)
    assert [p.name for p in report.programs][-1] == "forward[T=128]"
    m = report.memory
    assert m.num_state_slots == 1 + 1 * 2 * 2  # the null slot; one sequence, two slots, kept
    # 3 layers x 5 slots x (3 x 1024 bf16 conv inputs + 4 x 128 x 128 float32 states)
    assert m.state_pool_bytes == 3 * 5 * (3 * 1024 * 2 + 4 * 128 * 128 * 4)


def test_roofline_compares_targets_and_one_failure_hides_no_other() -> None:
    """`--target A B --roofline --json`: one object with `targets` and `rows`; v6e:1x1 cannot
    hold -tp 2 (its error is its row's), v5e:2x2 still gets its estimate, its price and the
    compiled cost of each decode step (worker/program_cost.py: an unrolled copy of the
    forward, the kernel's plan, the greedy sampler, compiled for the roofline alone since
    --programs leaves the samplers out; both devices together)."""
    cmd = [sys.executable, "-m", "jaxserve.preflight", "--target", "v6e:1x1", "v5e:2x2", "--json",
           "--roofline", "-tp", "2", "--programs", "forward", "--only-warm-up",
           # two decode batches (R in {1, 2}) and a prefill past the largest bucket (T=32)
           "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--max-model-len", "2048",
           *FIXED_CACHE]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    targets = {t["target"]: t for t in report["targets"]}
    assert not targets["v6e:1x1"]["fits"] and "devices" in targets["v6e:1x1"]["error"]
    v5e = targets["v5e:2x2"]
    assert v5e["fits"] and v5e["max_concurrent_seqs"] >= 1
    assert v5e["est_tokens_per_s_c1"] > 0 and v5e["usd_per_m_tokens"] > 0
    assert v5e["compile_s"]["roofline"] > 0  # TPU scans: the forward's unrolled copy compiled
    rows = [r for r in report["rows"] if r["target"] == "v5e:2x2"]
    assert {(r["program"], r["batch"], r["context"]) for r in rows} == {
        ("decode", 1, 1024), ("decode", 2, 1024), ("prefill", 1, 512), ("prefill", 1, 2048)}
    for r in rows:
        print(f"v5e:2x2 -tp 2 {r['program']} {r['batch']} x {r['context']}: compiled / ideal "
              f"bytes {r['compiled_bytes'] and r['compiled_bytes'] / r['ideal_bytes']}, parts "
              f"{r['compiled_parts']}")
        if r["bucket"] is None:  # more tokens than the largest bucket: no program to cost
            assert r["compiled_bytes"] is None and r["ideal_bytes"] > 0
            continue
        parts = r["compiled_parts"]
        assert r["compiled_bytes"] == pytest.approx(sum(b for _, b in parts.values()))
        # The forward reads at least the layers' weights (bf16; the LM head is the sampler's),
        # the kernel the context's KV (3 heads of 64 packed as 4: 1.33x), both devices together.
        layers = 30 * 2 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536)
        assert parts["forward"][1] >= layers
        kv = r["batch"] * 30 * 1024 * 2 * 3 * 64 * 2
        assert parts["attention"][1] == pytest.approx(kv * 4 / 3)
        assert parts["sampler"][1] >= 49152 * 576 * 2
        # Today's figure with room (docs/benchmarks.md: the 1.25x is not met): a new
        # copy of the weights (+0.7x) shows up here.
        assert r["compiled_bytes"] / r["ideal_bytes"] < BYTES_OVER_IDEAL_V5E_TP2
