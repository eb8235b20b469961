"""Worker: owns the mesh, the weights, the KV cache and the ModelRunner.

Start-up, in order:  load weights -> size the KV cache (num_blocks) ->
allocate it -> compile every bucket. `num_blocks` goes to the engine core as
an input; no config is mutated. On a GPU/TPU the size comes from the device compiler's
memory analysis of the largest programs (worker/kv_sizing.py); on the CPU from a byte budget.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Hashable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import kernels_pallas
import kernels_pallas.bf16_matmul as bf16_kernel
import kernels_pallas.int8_matmul as int8_kernel
from jaxserve.config import EngineConfig, ResolvedConfig, WeightFormat
from jaxserve.engine_core.model_runner_output import ModelRunnerOutput
from jaxserve.engine_core.sched_output import SchedulerOutput
from jaxserve.engine_core.spec_decode import MAX_DRAFT_TOKENS_PER_STEP
from jaxserve.models import ArchConfig
from jaxserve.models.attention import ModelOptions, kv_cache_layout
from jaxserve.models.loaders import load_checkpoint, read_arch
from jaxserve.models.loaders.hf import load_score_head
from jaxserve.models.loaders.orbax_loader import orbax_param_shapes, read_orbax_arch, restore_orbax
from jaxserve.models.model_files import ModelFiles, ModelFormat, resolve_model
from jaxserve.models.quantization import GROUP_SIZE, pack_params, param_bytes, quantize_params
from jaxserve.models.qwen3_next import HybridCache
from jaxserve.parallel.distributed import initialize_distributed
from jaxserve.parallel.mesh import make_mesh
from jaxserve.parallel.pipeline import Stage, abstract_stages, build_stages, random_weights
from jaxserve.parallel.sharding import adapt_heads, adapted_arch, head_layout, kv_cache_sharding, param_shardings
from jaxserve.worker.buckets import MIN_TOKEN_BUCKET, MIN_TOKEN_BUCKET_CPU
from jaxserve.worker.compile_cache import enable_compilation_cache
from jaxserve.worker.compile_progress import CompileProgress
from jaxserve.worker.kv_sizing import MemoryPlan, check_weights_fit, fmt_bytes, plan_kv_cache, refuse_too_few_pages
from jaxserve.worker.model_runner import ModelRunner
from jaxserve.worker.pooler import Pooler
from jaxserve.worker.programs import CompiledProgram, compile_program, per_device_bytes, signature, sizing_programs
from jaxserve.worker.sampler import ThresholdSearch
from jaxserve.worker.step_handle import StepHandle

logger = logging.getLogger(__name__)

# With no device memory to profile on the CPU, the KV cache gets this budget
# unless --kv-cache-memory-bytes says otherwise.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
# Top-k / top-p's threshold search (sampler.largest_threshold): the CPU is compute-bound there
# (one compare per pass: 1 bit a pass), a TPU or GPU bandwidth-bound (fewer passes over
# [rows, vocab], 15 compares each); a loop on the CPU (each filtered sampler compiled in a
# fifth of the time, as fast), unrolled on devices, whose roofline counts every pass.
# docs/benchmarks.md has the measurements.
THRESHOLD_SEARCH_CPU = ThresholdSearch(radix_bits=1, unrolled=False)
THRESHOLD_SEARCH_DEVICE = ThresholdSearch(radix_bits=4, unrolled=True)
# XLA's CPU compiler: its older (LLVM IR) fusion emitters compile the engine's programs
# faster than the MLIR ones, and the steps run as fast (the matmuls and attention are oneDNN's
# or our kernels'): docs/benchmarks.md, "Compiling less at start-up".
CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


def _needs_head_adaptation(files: ModelFiles, tp: int) -> bool:
    if tp == 1:
        return False
    arch = read_arch(files)
    return head_layout(arch, tp).num_kv_heads != arch.num_key_value_heads


def weight_matmul_path(fmt: WeightFormat, platform: str, tp: int) -> str | None:
    """Which matmul a quantized model's projections run (logged at start-up: slow decode ->
    look here); None for float weights."""
    if not fmt.quantized:
        return None
    if platform != "cpu":
        return "XLA (widen + dot, fused)"
    if tp > 1:
        return "XLA (tensor parallel: the CPU kernels have no sharding rule)"
    if fmt.packed:
        few = (f"an AVX512-BF16 kernel up to {bf16_kernel.PACKED_FEW_TOKENS} tokens a step, oneDNN beyond"
               if bf16_kernel.cpu.avx512_bf16() else "oneDNN at every token count")
        return f"weights packed at load in oneDNN's layout: {few} (--no-cpu-packed-weights keeps plain rows)"
    if fmt.scaled:  # int8 values (a checkpoint's fp8 and int4 are served so on GPU/TPU only)
        if not int8_kernel.cpu.available():
            return f"XLA (CPU kernel unavailable: {int8_kernel.cpu.unavailable_reason()})"
        return f"CPU kernel up to {int8_kernel.CPU_KERNEL_MAX_TOKENS} tokens a step, XLA beyond"
    if not bf16_kernel.cpu.available():
        return f"XLA (CPU kernel unavailable: {bf16_kernel.cpu.unavailable_reason()})"
    many = ("oneDNN bf16 beyond" if bf16_kernel.cpu.onednn_available()
            else f"XLA beyond (oneDNN unavailable: {bf16_kernel.cpu.onednn_unavailable_reason()})")
    return f"CPU kernel up to {bf16_kernel.CPU_KERNEL_MAX_TOKENS} tokens a step, {many}"


JAX_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class Worker:
    # Set by load_model / load_abstract_model.
    stages: list[Stage]
    arch: ArchConfig  # the checkpoint's
    run_arch: ArchConfig  # with the head counts tensor parallelism divides

    def __init__(self, config: EngineConfig, model_files: ModelFiles | None = None,
                 devices: list[jax.Device] | None = None) -> None:
        """`config`: resolved (jaxserve/engine/resolve.py) for these `devices`: the process's
        own, or e.g. compile-only TPU/GPU devices for the preflight (such a worker only
        `load_abstract_model`s). The worker reads the settings; it decides none."""
        if config.resolved is None:
            raise ValueError("Worker needs a resolved config: "
                             "jaxserve.engine.resolve.resolve_engine_config(config, ...)")
        enable_compilation_cache()
        self.config = config
        self.model_files = model_files or resolve_model(config.model_config.model,
                                                            config.model_config.hf_overrides)
        # Before anything touches a device: join the other hosts, if any (the resolution
        # stage did for the process's own devices; this is a no-op then).
        self.distributed = initialize_distributed(config.parallel_config)
        self.mesh = make_mesh(config.parallel_config, devices)
        r = config.resolved
        self.platform = r.platform
        self.dtype = JAX_DTYPES[r.dtype]
        self.weight_format = r.weight_format
        self.attention_backend = r.attention_backend
        self.max_model_len = r.max_model_len
        self.kv_cache_groups = r.kv_cache_groups
        # The linear-attention layers' state pool (0: none), carved from the KV budget first.
        self.num_state_slots = r.kv_cache_groups.num_state_slots(config.scheduler_config.max_num_seqs)
        # Every stage's model runs with these (its own sub-mesh set per stage).
        self.model_options = ModelOptions(
            dtype=self.dtype, attention_backend=self.attention_backend,
            attention_interpret=config.attention_interpret, weight_format=self.weight_format,
            weight_group_size=r.weight_group_size if self.weight_format.from_checkpoint else GROUP_SIZE,
            weight_act_order=r.weight_act_order,
            kv_cache_dtype=r.kv_cache_dtype, kv_cache_groups=r.kv_cache_groups,
            expert_parallel=config.parallel_config.enable_expert_parallel,
            experts_format=r.experts_weight_format, platform=self.platform)
        self.runner: ModelRunner | None = None
        self.timings: dict[str, float] = {}
        self.memory_plan: MemoryPlan | None = None  # a GPU/TPU's sizing (None on the CPU)
        self.sizing_programs: list[CompiledProgram] = []
        # Their reports by programs.signature, for compile_programs to reuse (preflight).
        self.sizing_compiled: dict[Hashable, CompiledProgram] = {}
        self.score_head: np.ndarray | None = None  # a classifier's head, on the host

    @property
    def resolved(self) -> ResolvedConfig:
        """The settings the resolution stage decided (__init__ refuses a config without)."""
        assert self.config.resolved is not None
        return self.config.resolved

    def load_model(self) -> None:
        t0 = time.perf_counter()
        if self.config.model_config.load_format == "dummy":
            self.load_abstract_model()
            self.stages = [dataclasses.replace(st, params=random_weights(st.params, i))
                           for i, st in enumerate(self.stages)]
            if (head := self.resolved.classifier) is not None:
                self.score_head = np.random.default_rng(0).normal(
                    0, 0.02, (head.num_labels, self.arch.hidden_size)).astype(np.float32)
            self.timings["load_s"] = time.perf_counter() - t0
            return
        tp = self.config.parallel_config.tensor_parallel_size
        self.arch, host_params = self._read_weights(tp)
        # The model runs with head counts tp divides; `self.arch` stays the checkpoint's.
        self.run_arch, host_params = adapt_heads(self.arch, host_params, tp)
        host_params = quantize_params(host_params, self.weight_format)  # if not read quantized
        if self.weight_format.packed:
            host_params = pack_params(host_params, self.run_arch.tie_word_embeddings)
        self.stages = build_stages(self.run_arch, host_params, self.mesh, self.model_options)
        self.weight_bytes = sum(param_bytes(st.params) for st in self.stages)
        self.weight_matmul = weight_matmul_path(self.weight_format, self.platform, tp)
        if (head := self.resolved.classifier) is not None:
            self.score_head = load_score_head(self.model_files.path, head, self.arch.hidden_size)
        self.timings["load_s"] = time.perf_counter() - t0

    def load_abstract_model(self) -> None:
        """`load_model` without weights: the stages' params are ShapeDtypeStructs with their
        shardings (from config.json or the GGUF header alone), for compiling and sizing."""
        tp = self.config.parallel_config.tensor_parallel_size
        self.arch = read_arch(self.model_files)
        self.run_arch = adapted_arch(self.arch, tp)
        self.stages = abstract_stages(self.run_arch, self.mesh, self.model_options)
        self.weight_bytes = sum(param_bytes(st.params) for st in self.stages)
        self.weight_matmul = weight_matmul_path(self.weight_format, self.platform, tp)

    def _read_weights(self, tp: int) -> tuple[ArchConfig, Any]:
        """Host NumPy weights; or, for an Orbax checkpoint that needs no head padding and
        no pipeline split, device arrays restored straight into their shardings."""
        files, pc = self.model_files, self.config.parallel_config
        quantized = self.weight_format.quantized
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
        return load_checkpoint(files, self.dtype,
                               self.weight_format if read_as_int8 else WeightFormat.FLOAT,
                               self.resolved.experts_weight_format)

    @property
    def kv_layout(self) -> kernels_pallas.KVCacheLayout:
        """One device's cache layout (kernels_pallas/kv_cache.py)."""
        return kv_cache_layout(self.run_arch, self.attention_backend,
                               self.resolved.kv_cache_dtype,
                               self.config.parallel_config.tensor_parallel_size)

    def page_bytes(self) -> int:
        """Bytes of one KV page on the busiest device: its stage's layers, its share of heads."""
        return max(per_device_bytes(_pages(self._cache_struct(st, 1, 0))) for st in self.stages)

    def state_pool_bytes(self) -> int:
        """Bytes of the linear-attention layers' state pool on the busiest device (0: none)."""
        if not self.num_state_slots:
            return 0
        return max(per_device_bytes(self._cache_struct(st, 0)) for st in self.stages)

    def _cache_struct(self, st: Stage, num_blocks: int, num_state_slots: int | None = None) -> Any:
        """The stage's cache as sharded ShapeDtypeStructs: its pages (split by heads), and a
        Gated DeltaNet hybrid's state pool (`HybridCache`, replicated: one device so far)."""
        slots = self.num_state_slots if num_state_slots is None else num_state_slots
        spec = st.model.kv_cache(num_blocks, self.config.cache_config.block_size, slots)
        if isinstance(spec, HybridCache):
            replicated = NamedSharding(st.mesh, PartitionSpec())
            kv = jax.ShapeDtypeStruct(spec.kv.shape, spec.kv.dtype,
                                      sharding=kv_cache_sharding(st.mesh, spec.kv.shape))
            conv, ssm = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated)
                         for a in (spec.conv, spec.ssm))
            return HybridCache(kv, conv, ssm)  # type: ignore[arg-type]  # its arrays' shapes
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
            num_blocks = max(budget - self.state_pool_bytes(), 0) // self.page_bytes()
            knob = "--kv-cache-memory-bytes"
            given_by = (f"{knob} {budget}" if cc.kv_cache_memory_bytes
                        else f"the CPU's default KV budget ({fmt_bytes(budget)})")
        refuse_too_few_pages(num_blocks, cc.block_size, self.max_model_len, given_by, knob,
                             self.kv_cache_groups, self.config.scheduler_config.max_num_batched_tokens)
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
                          page_bytes // cc.block_size, self.kv_cache_groups)
        if cc.num_gpu_blocks_override is not None:  # the pages are given: nothing to measure
            activations = 0
            budget = cc.num_gpu_blocks_override * page_bytes + self.state_pool_bytes()
            given_by = f"--num-gpu-blocks-override {cc.num_gpu_blocks_override}"
        else:
            programs = sizing_programs(probe.programs())
            self.sizing_programs = []
            with CompileProgress(len(programs), "Sizing the KV cache",
                                 show=self.shows_progress()) as progress:
                for p in programs:
                    with progress.compiling(p.name):
                        self.sizing_programs.append(compile_program(p, compiler_options)[0])
                    progress.done()
            # A program that takes no cache (a sampler, prompt logprobs) is the same at any page
            # count: the final compile reuses its report (a forward's signature differs).
            self.sizing_compiled = {signature(p): c for p, c in zip(programs, self.sizing_programs)}
            activations = max(c.activation_bytes for c in self.sizing_programs)
        return plan_kv_cache(
            device=device, memory_bytes=memory_bytes, utilization=cc.gpu_memory_utilization,
            weight_bytes=weights, state_bytes=state, activation_bytes=activations,
            page_bytes=page_bytes, page_size=cc.block_size, max_model_len=self.max_model_len,
            groups=self.kv_cache_groups,
            chunk=self.config.scheduler_config.max_num_batched_tokens,
            kv_cache_memory_bytes=budget, given_by=given_by,
            num_state_slots=self.num_state_slots, state_pool_bytes=self.state_pool_bytes())

    def device_memory(self) -> tuple[int, str]:
        """(bytes the runtime lets the engine use, device kind) of the first device."""
        dev = self.mesh.devices.flat[0]
        return int(dev.memory_stats()["bytes_limit"]), dev.device_kind

    def _min_num_blocks(self) -> int:
        """A cache of one max_model_len sequence (and the null page): what sizing compiles with."""
        return self.kv_cache_groups.min_num_blocks(
            self.max_model_len, self.config.cache_config.block_size,
            self.config.scheduler_config.max_num_batched_tokens)

    def make_runner(self, num_blocks: int, abstract: bool = False) -> ModelRunner:
        """The ModelRunner over this worker's stages with a `num_blocks` cache: allocated, or
        (`abstract`) ShapeDtypeStructs for compiling on devices the process may not drive."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        stages = self.stages
        if abstract:
            # An abstract runner's cache is its ShapeDtypeStruct (Stage types the real one).
            stages = [dataclasses.replace(st, kv_cache=cast(jax.Array, self._cache_struct(st, num_blocks)))
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
            threshold_search=(THRESHOLD_SEARCH_CPU if self.platform == "cpu"
                              else THRESHOLD_SEARCH_DEVICE),
            pooler=Pooler(sc.max_num_seqs, self.score_head, self.resolved.classifier),
            compiler_options=CPU_COMPILER_OPTIONS if self.platform == "cpu" else None,
        )

    def initialize_cache(self, num_blocks: int) -> None:
        for st in self.stages:
            spec = self._cache_struct(st, num_blocks)
            st.kv_cache = jax.jit(
                functools.partial(jax.tree.map, lambda s: jnp.zeros(s.shape, s.dtype), spec),
                out_shardings=jax.tree.map(lambda s: s.sharding, spec))()
        self.num_blocks = num_blocks
        self.runner = self.make_runner(num_blocks)

    def compile_or_warm_up(self) -> None:
        if self.config.enforce_eager:
            return
        assert self.runner is not None
        self.timings["compile_s"] = self.runner.warm_up(show_progress=self.shows_progress())

    def shows_progress(self) -> bool:
        """One progress display per server, as vLLM shows its graph capture on the first rank:
        each data-parallel engine is JAX process 0 of its own."""
        return self.config.parallel_config.data_parallel_rank == 0 and jax.process_index() == 0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None
        return self.runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        assert self.runner is not None
        return self.runner.execute_model_async(scheduler_output)


def _pages(cache: Any) -> Any:
    """The attention pages of a stage's cache (a hybrid's `HybridCache.kv`)."""
    return cache.kv if isinstance(cache, HybridCache) else cache


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
