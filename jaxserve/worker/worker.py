"""Worker: owns the mesh, the weights, the KV cache and the ModelRunner.

Start-up, in order:  load weights -> size the KV cache (num_blocks) ->
allocate it -> compile every bucket. `num_blocks` goes to the engine core as
an input; no config is mutated. On a GPU/TPU the size comes from the device compiler's
memory analysis of the largest programs (worker/kv_sizing.py); on the CPU from a byte budget.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import kernels_pallas
import kernels_pallas.bf16_matmul as bf16_kernel
import kernels_pallas.int8_matmul as int8_kernel
from jaxserve.config import CPU_AUTO_BF16_ENV, EngineConfig
from jaxserve.engine_core.model_runner_output import ModelRunnerOutput
from jaxserve.engine_core.spec_decode import MAX_DRAFT_TOKENS_PER_STEP
from jaxserve.engine_core.sched_output import SchedulerOutput
from jaxserve.models.model_files import ModelFiles, ModelFormat, resolve_model
from jaxserve.models import ArchConfig
from jaxserve.models.attention import ModelOptions, kv_cache_layout
from jaxserve.models.loaders import load_checkpoint, read_arch
from jaxserve.models.quantization import pack_params, param_bytes, quantize_params
from jaxserve.models.loaders.orbax_loader import orbax_param_shapes, read_orbax_arch, restore_orbax
from jaxserve.parallel.distributed import initialize_distributed
from jaxserve.parallel.mesh import make_mesh
from jaxserve.parallel.pipeline import Stage, abstract_stages, build_stages, random_weights
from jaxserve.parallel.sharding import (
    adapt_heads, adapted_arch, head_layout, kv_cache_sharding, param_shardings)
from jaxserve.worker.buckets import MIN_TOKEN_BUCKET, MIN_TOKEN_BUCKET_CPU
from jaxserve.worker.compile_cache import enable_compilation_cache
from jaxserve.worker.kv_sizing import (MemoryPlan, check_weights_fit, fmt_bytes, plan_kv_cache,
                                       refuse_too_few_pages)
from jaxserve.worker.model_runner import ModelRunner
from jaxserve.worker.programs import CompiledProgram, compile_program, per_device_bytes, sizing_programs
from jaxserve.worker.step_handle import StepHandle

logger = logging.getLogger(__name__)

# With no device memory to profile on the CPU, the KV cache gets this budget
# unless --kv-cache-memory-bytes says otherwise.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


def _needs_head_adaptation(files: ModelFiles, tp: int) -> bool:
    if tp == 1:
        return False
    arch = read_arch(files)
    return head_layout(arch, tp).num_kv_heads != arch.num_key_value_heads


def resolve_dtype(dtype: str, platform: str) -> Any:
    """`auto` is bfloat16 on GPU/TPU and float32 on the CPU (XLA's bf16 is slower there:
    docs/benchmarks.md, "Figures the code's comments used to hold")."""
    if dtype == "auto":
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[dtype]


# jax.Device.platform -> the platform names kernel variants declare (jax.export's).
_EXPORT_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}
# The platform's own attention kernel, picked by attention_backend="auto".
AUTO_ATTENTION_BACKEND = kernels_pallas.PLATFORM_BACKENDS


def resolve_attention_backend(name: str, platform: str, interpret: bool) -> str:
    """`auto` -> the platform's own variant; any other name must target `platform`, unless
    `interpret` runs it in Pallas interpret mode (tests, research on the CPU)."""
    target = _EXPORT_PLATFORM.get(platform, platform)
    if name == "auto":
        if target not in AUTO_ATTENTION_BACKEND:
            raise ValueError(f"no attention kernel for platform {platform!r}; pass "
                             f"--attention-backend reference")
        name = AUTO_ATTENTION_BACKEND[target]
    backend = kernels_pallas.get_backend(name)  # ValueError listing the variants if unknown
    if target not in backend.platforms and not (interpret and backend.interpretable):
        raise ValueError(
            f"attention backend {name!r} targets {', '.join(backend.platforms)}, not this "
            f"{platform} device; use --attention-backend auto, or --attention-interpret to run "
            f"it in Pallas interpret mode"
        )
    return name


def resolve_max_model_len(requested: int | None, arch: ArchConfig) -> int:
    if requested is None:
        return arch.context_length
    if requested > arch.context_length:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's context length "
            f"{arch.context_length}"
        )
    return requested


def resolve_quantization(quantization: str | None, dtype: str, platform: str, tp: int, pp: int,
                         arch: Callable[[], ArchConfig], cpu_auto_bf16: bool = True,
                         ) -> tuple[str | None, str]:
    """The weight format the model runs, and why. An explicit `--quantization` is kept. With
    `--dtype auto` on a CPU whose bf16 units oneDNN drives natively (AVX512-BF16 or AMX), a
    dense model with one device per stage gets bf16 weights (float32 activations between the
    matmuls, float32 sums; `resolve_packed_weights` decides their layout): it is the fastest
    path there, and its greedy agreement with float32 is README's
    "Quantization" figure. Everything else keeps the dtype's float weights, as does
    `cpu_auto_bf16=False` (--no-cpu-auto-bf16). `arch` is called (the checkpoint's header
    read) only when the answer depends on it."""
    if quantization is not None:
        return quantization, "--quantization"
    if dtype != "auto" or platform != "cpu":
        return None, f"--dtype {dtype} on {platform}"
    if not cpu_auto_bf16:
        return None, f"--no-cpu-auto-bf16 (or {CPU_AUTO_BF16_ENV}=0)"
    if tp > 1 or pp > 1:
        return None, "float32 weights under tensor/pipeline parallelism (the CPU kernels have no sharding rule)"
    if arch().num_experts:
        return None, "float32 weights: bf16 does not cover mixture-of-experts models"
    if not bf16_kernel.cpu.onednn_available():
        return None, f"float32 weights: no native bf16 matmul ({bf16_kernel.cpu.onednn_unavailable_reason()})"
    return "bf16", "bf16 weights: --dtype auto on a CPU with bf16 units (--no-cpu-auto-bf16 or --dtype float32 keeps float32)"


def resolve_packed_weights(quantization: str | None, platform: str, tp: int, pp: int,
                           allowed: bool = True) -> bool:
    """Whether bf16 weights are packed at load into oneDNN's blocked layout: on a CPU where
    oneDNN's bf16 matmul is native, with one device per stage, unless not `allowed`
    (--no-cpu-packed-weights keeps them in plain [out, in] rows: the few-token AVX2 kernel and
    oneDNN with per-call repacking). Packed, every token count runs without repacking the
    weights per call, faster than the plain-row paths at every batch size measured
    (docs/benchmarks.md, "Packed bf16 weights")."""
    return (quantization == "bf16" and platform == "cpu" and tp == 1 and pp == 1
            and allowed and bf16_kernel.packing_available())


def weight_matmul_path(quantization: str | None, platform: str, tp: int,
                       packed: bool = False) -> str | None:
    """Which matmul a quantized model's projections run (logged at start-up: slow decode ->
    look here); None for float weights."""
    if quantization is None:
        return None
    if platform != "cpu":
        return "XLA (widen + dot, fused)"
    if tp > 1:
        return "XLA (tensor parallel: the CPU kernels have no sharding rule)"
    if packed:
        few = (f"an AVX512-BF16 kernel up to {bf16_kernel.PACKED_FEW_TOKENS} tokens a step, oneDNN beyond"
               if bf16_kernel.cpu.avx512_bf16() else "oneDNN at every token count")
        return f"weights packed at load in oneDNN's layout: {few} (--no-cpu-packed-weights keeps plain rows)"
    if quantization == "int8":
        if not int8_kernel.cpu.available():
            return f"XLA (CPU kernel unavailable: {int8_kernel.cpu.unavailable_reason()})"
        return f"CPU kernel up to {int8_kernel.CPU_KERNEL_MAX_TOKENS} tokens a step, XLA beyond"
    if not bf16_kernel.cpu.available():
        return f"XLA (CPU kernel unavailable: {bf16_kernel.cpu.unavailable_reason()})"
    many = ("oneDNN bf16 beyond" if bf16_kernel.cpu.onednn_available()
            else f"XLA beyond (oneDNN unavailable: {bf16_kernel.cpu.onednn_unavailable_reason()})")
    return f"CPU kernel up to {bf16_kernel.CPU_KERNEL_MAX_TOKENS} tokens a step, {many}"


class Worker:
    def __init__(self, config: EngineConfig, model_files: ModelFiles | None = None,
                 devices: list[jax.Device] | None = None) -> None:
        """`devices`: run on these (e.g. compile-only TPU/GPU devices for the preflight)
        instead of the process's own; such a worker only `load_abstract_model`s."""
        enable_compilation_cache()
        self.config = config
        self.model_files = model_files or resolve_model(config.model_config.model)
        # Before anything touches a device: join the other hosts, if any.
        self.distributed = initialize_distributed(config.parallel_config)
        self.mesh = make_mesh(config.parallel_config, devices)
        self.platform = self.mesh.devices.flat[0].platform
        self.dtype = resolve_dtype(config.model_config.dtype, self.platform)
        pc = config.parallel_config
        # The weight format in use; the config keeps what was asked (build_worker reports both).
        self.quantization, self.quantization_reason = resolve_quantization(
            config.model_config.quantization, config.model_config.dtype, self.platform,
            pc.tensor_parallel_size, pc.pipeline_parallel_size, lambda: read_arch(self.model_files),
            config.model_config.cpu_auto_bf16)
        self.attention_backend = resolve_attention_backend(
            config.attention_backend, self.platform, config.attention_interpret)
        # Every stage's model runs with these (its own sub-mesh set per stage).
        self.packed_weights = resolve_packed_weights(
            self.quantization, self.platform, pc.tensor_parallel_size, pc.pipeline_parallel_size,
            config.model_config.cpu_packed_weights)
        self.model_options = ModelOptions(
            self.dtype, self.attention_backend, config.attention_interpret, None,
            self.quantization, config.cache_config.cache_dtype,
            config.parallel_config.enable_expert_parallel, self.platform, self.packed_weights)
        self.runner: ModelRunner | None = None
        self.timings: dict[str, float] = {}
        self.memory_plan: MemoryPlan | None = None  # a GPU/TPU's sizing (None on the CPU)
        self.sizing_programs: list[CompiledProgram] = []

    def load_model(self) -> None:
        t0 = time.perf_counter()
        if self.config.model_config.load_format == "dummy":
            self.load_abstract_model()
            self.stages = [dataclasses.replace(st, params=random_weights(st.params, i))
                           for i, st in enumerate(self.stages)]
            self.timings["load_s"] = time.perf_counter() - t0
            return
        tp = self.config.parallel_config.tensor_parallel_size
        self.arch, host_params = self._read_weights(tp)
        self.max_model_len = resolve_max_model_len(self.config.model_config.max_model_len, self.arch)
        # The model runs with head counts tp divides; `self.arch` stays the checkpoint's.
        self.run_arch, host_params = adapt_heads(self.arch, host_params, tp)
        quantization = self.quantization
        host_params = quantize_params(host_params, quantization)  # if not read quantized
        if self.packed_weights:
            host_params = pack_params(host_params, self.run_arch.tie_word_embeddings)
        self.stages = build_stages(self.run_arch, host_params, self.mesh, self.model_options)
        self.weight_bytes = sum(param_bytes(st.params) for st in self.stages)
        self.weight_matmul = weight_matmul_path(quantization, self.platform, tp, self.packed_weights)
        self.timings["load_s"] = time.perf_counter() - t0

    def load_abstract_model(self) -> None:
        """`load_model` without weights: the stages' params are ShapeDtypeStructs with their
        shardings (from config.json or the GGUF header alone), for compiling and sizing."""
        tp = self.config.parallel_config.tensor_parallel_size
        self.arch = read_arch(self.model_files)
        self.max_model_len = resolve_max_model_len(self.config.model_config.max_model_len, self.arch)
        self.run_arch = adapted_arch(self.arch, tp)
        quantization = self.quantization
        self.stages = abstract_stages(self.run_arch, self.mesh, self.model_options)
        self.weight_bytes = sum(param_bytes(st.params) for st in self.stages)
        self.weight_matmul = weight_matmul_path(quantization, self.platform, tp, self.packed_weights)

    def _read_weights(self, tp: int) -> tuple[ArchConfig, Any]:
        """Host NumPy weights; or, for an Orbax checkpoint that needs no head padding and
        no pipeline split, device arrays restored straight into their shardings."""
        files, pc = self.model_files, self.config.parallel_config
        quantized = self.quantization is not None
        if files.format == ModelFormat.ORBAX and pc.pipeline_parallel_size == 1 and not quantized:
            arch = read_orbax_arch(files.path)
            lay = head_layout(arch, tp)
            if lay.num_kv_heads == arch.num_key_value_heads:
                shardings = param_shardings(orbax_param_shapes(files.path), self.mesh,
                                            self.model_options.expert_parallel)
                return arch, restore_orbax(files.path, self.dtype, shardings)
        # Heads are padded / replicated for tp on float weights; otherwise quantized weights
        # are read in their format, one tensor at a time.
        read_as_int8 = quantized and not _needs_head_adaptation(files, tp)
        return load_checkpoint(files, self.dtype, self.quantization if read_as_int8 else None)

    @property
    def kv_layout(self) -> kernels_pallas.KVCacheLayout:
        """One device's cache layout (kernels_pallas/kv_cache.py)."""
        return kv_cache_layout(self.run_arch, self.dtype, self.attention_backend,
                               self.config.cache_config.cache_dtype,
                               self.config.parallel_config.tensor_parallel_size)

    def page_bytes(self) -> int:
        """Bytes of one KV page on the busiest device: its stage's layers, its share of heads."""
        return max(per_device_bytes(self._cache_struct(st, 1)) for st in self.stages)

    def _cache_struct(self, st: Stage, num_blocks: int) -> jax.ShapeDtypeStruct:
        spec = st.model.kv_cache(num_blocks, self.config.cache_config.block_size)
        return jax.ShapeDtypeStruct(spec.shape, spec.dtype,
                                    sharding=kv_cache_sharding(st.mesh, spec.shape))

    def determine_num_blocks(self) -> int:
        """How many KV pages fit the memory budget (page 0 included, as the null page)."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is None and self.platform != "cpu":
            self.memory_plan = self.plan_memory()
            logger.info("kv_cache_manager: %s", self.memory_plan.summary())
            return self.memory_plan.num_pages
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
            given_by = knob = "--num-gpu-blocks-override"
            given_by += f" {num_blocks}"
        else:
            budget = cc.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
            num_blocks = budget // self.page_bytes()
            knob = "--kv-cache-memory-bytes"
            given_by = (f"{knob} {budget}" if cc.kv_cache_memory_bytes
                        else f"the CPU's default KV budget ({fmt_bytes(budget)})")
        refuse_too_few_pages(num_blocks, cc.block_size, self.max_model_len, given_by, knob)
        return int(num_blocks)

    def plan_memory(self, memory_bytes: int | None = None, device: str | None = None,
                    compiler_options: dict[str, Any] | None = None) -> MemoryPlan:
        """Size the cache from the device compiler: weights + the largest program's
        activations + the cache fill `gpu_memory_utilization` of the device. Refuses (an
        InsufficientMemoryError naming the figures and knobs) before compiling anything when
        the weights alone do not fit. `memory_bytes`/`device` default to the first device's."""
        if memory_bytes is None:
            memory_bytes, device = self.device_memory()
        device = device or self.mesh.devices.flat[0].device_kind
        cc = self.config.cache_config
        weights = max(per_device_bytes(st.params) for st in self.stages)
        probe = self.make_runner(self._min_num_blocks(), abstract=True)
        state = per_device_bytes(probe.state_bytes())
        page_bytes, budget = self.page_bytes(), cc.kv_cache_memory_bytes
        given_by = None if budget is None else f"--kv-cache-memory-bytes {budget}"
        check_weights_fit(device, memory_bytes, cc.gpu_memory_utilization, weights, state,
                          page_bytes // cc.block_size)
        if cc.num_gpu_blocks_override is not None:  # the pages are given: nothing to measure
            activations, budget = 0, cc.num_gpu_blocks_override * page_bytes
            given_by = f"--num-gpu-blocks-override {cc.num_gpu_blocks_override}"
        else:
            self.sizing_programs = [compile_program(p, compiler_options)[0]
                                    for p in sizing_programs(probe.programs())]
            activations = max(c.activation_bytes for c in self.sizing_programs)
        return plan_kv_cache(
            device=device, memory_bytes=memory_bytes, utilization=cc.gpu_memory_utilization,
            weight_bytes=weights, state_bytes=state, activation_bytes=activations,
            page_bytes=page_bytes, page_size=cc.block_size, max_model_len=self.max_model_len,
            kv_cache_memory_bytes=budget, given_by=given_by)

    def device_memory(self) -> tuple[int, str]:
        """(bytes the runtime lets the engine use, device kind) of the first device."""
        dev = self.mesh.devices.flat[0]
        return int(dev.memory_stats()["bytes_limit"]), dev.device_kind

    def _min_num_blocks(self) -> int:
        """A cache of one max_model_len sequence (and the null page): what sizing compiles with."""
        return -(-self.max_model_len // self.config.cache_config.block_size) + 1

    def make_runner(self, num_blocks: int, abstract: bool = False) -> ModelRunner:
        """The ModelRunner over this worker's stages with a `num_blocks` cache: allocated, or
        (`abstract`) ShapeDtypeStructs for compiling on devices the process may not drive."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        stages = self.stages
        if abstract:
            stages = [dataclasses.replace(st, kv_cache=self._cache_struct(st, num_blocks))
                      for st in self.stages]
        return ModelRunner(
            stages,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=cc.block_size,
            min_token_bucket=MIN_TOKEN_BUCKET_CPU if self.platform == "cpu" else MIN_TOKEN_BUCKET,
            seed=self.config.model_config.seed,
            max_verify_rows=_max_verify_rows(self.config),
            # Not under async scheduling's placeholders: there a step is prepared before the
            # previous one's tokens are back, and when a multi-host follower (which waits for
            # each step at once) would know them, its inputs would differ from process 0's.
            record_sampled=not sc.async_scheduling,
            abstract=abstract,
            logprobs_branch=self.platform == "cpu",
        )

    def initialize_cache(self, num_blocks: int) -> None:
        for st in self.stages:
            spec = self._cache_struct(st, num_blocks)
            st.kv_cache = jax.jit(lambda: jnp.zeros(spec.shape, spec.dtype),
                                  out_shardings=spec.sharding)()
        self.num_blocks = num_blocks
        self.runner = self.make_runner(num_blocks)

    def compile_or_warm_up(self) -> None:
        if self.config.enforce_eager:
            return
        assert self.runner is not None
        self.timings["compile_s"] = self.runner.warm_up()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None
        return self.runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        assert self.runner is not None
        return self.runner.execute_model_async(scheduler_output)


def _max_verify_rows(config: EngineConfig) -> int:
    """The most logits rows of a step with drafts (0: no speculative decoding): requests
    speculate only while at most `disable_by_batch_size` run, each with k + 1 rows, and a
    step carries at most MAX_DRAFT_TOKENS_PER_STEP drafts."""
    spec, sc = config.speculative_config, config.scheduler_config
    if spec is None:
        return 0
    requests = min(sc.max_num_seqs, spec.disable_by_batch_size or sc.max_num_seqs)
    return min(requests * (spec.num_speculative_tokens + 1), sc.max_num_batched_tokens,
               sc.max_num_seqs + MAX_DRAFT_TOKENS_PER_STEP)
