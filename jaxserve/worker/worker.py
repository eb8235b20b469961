"""Worker: owns the mesh, the weights, the KV cache and the ModelRunner.

Start-up, in order:  load weights -> size the KV cache (num_blocks) ->
allocate it -> compile every bucket. `num_blocks` goes to the engine core as
an input; no config is mutated.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp

import kernels_pallas
from kernels_pallas.int8_matmul import CPU_KERNEL_MAX_TOKENS, cpu as int8_cpu
from jaxserve.config import EngineConfig
from jaxserve.engine_core.model_runner_output import ModelRunnerOutput
from jaxserve.engine_core.spec_decode import MAX_DRAFT_TOKENS_PER_STEP
from jaxserve.engine_core.sched_output import SchedulerOutput
from jaxserve.model_files import ModelFiles, ModelFormat, resolve_model
from jaxserve.models import ArchConfig, kv_cache_shape
from jaxserve.models.llama import kv_cache_storage_dtype
from jaxserve.models.loaders import load_checkpoint, read_arch
from jaxserve.models.quantization import param_bytes, quantize_params
from jaxserve.models.loaders.orbax_loader import orbax_param_shapes, read_orbax_arch, restore_orbax
from jaxserve.parallel.distributed import initialize_distributed
from jaxserve.parallel.mesh import make_mesh
from jaxserve.parallel.pipeline import build_stages
from jaxserve.parallel.sharding import adapt_heads, head_layout, kv_cache_sharding, param_shardings
from jaxserve.worker.buckets import MIN_TOKEN_BUCKET, MIN_TOKEN_BUCKET_CPU
from jaxserve.worker.compile_cache import enable_compilation_cache
from jaxserve.worker.model_runner import ModelRunner
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
    """`auto` is bfloat16 on GPU/TPU and float32 on the CPU (bf16 is 3-6x slower there)."""
    if dtype == "auto":
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[dtype]


# jax.Device.platform -> the platform names kernel variants declare (jax.export's).
_EXPORT_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}
# The platform's own attention kernel, picked by attention_backend="auto".
AUTO_ATTENTION_BACKEND = {"cpu": "cpu", "cuda": "gpu", "tpu": "tpu"}


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
        return arch.max_position_embeddings
    if requested > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's context length "
            f"{arch.max_position_embeddings}"
        )
    return requested


def int8_matmul_path(quantization: str | None, platform: str, tp: int) -> str | None:
    """Which int8 matmul the model runs (logged at start-up: slow decode -> look here)."""
    if quantization != "int8":
        return None
    if platform != "cpu":
        return "XLA (dequantize + dot, fused)"
    if tp > 1:
        return "XLA (tensor parallel: the CPU kernel has no sharding rule)"
    if not int8_cpu.available():
        return f"XLA (CPU kernel unavailable: {int8_cpu.unavailable_reason()})"
    return f"CPU kernel up to {CPU_KERNEL_MAX_TOKENS} tokens a step, XLA beyond"


class Worker:
    def __init__(self, config: EngineConfig, model_files: ModelFiles | None = None) -> None:
        enable_compilation_cache()
        self.config = config
        self.model_files = model_files or resolve_model(config.model_config.model)
        # Before anything touches a device: join the other hosts, if any.
        self.distributed = initialize_distributed(config.parallel_config)
        self.mesh = make_mesh(config.parallel_config)
        self.platform = self.mesh.devices.flat[0].platform
        self.dtype = resolve_dtype(config.model_config.dtype, self.platform)
        self.kv_dtype = kv_cache_storage_dtype(config.cache_config.cache_dtype, self.dtype)
        self.attention_backend = resolve_attention_backend(
            config.attention_backend, self.platform, config.attention_interpret)
        self.runner: ModelRunner | None = None
        self.timings: dict[str, float] = {}

    def load_model(self) -> None:
        t0 = time.perf_counter()
        tp = self.config.parallel_config.tensor_parallel_size
        self.arch, host_params = self._read_weights(tp)
        self.max_model_len = resolve_max_model_len(self.config.model_config.max_model_len, self.arch)
        # The model runs with head counts tp divides; `self.arch` stays the checkpoint's.
        self.run_arch, host_params = adapt_heads(self.arch, host_params, tp)
        quantization = self.config.model_config.quantization
        host_params = quantize_params(host_params, quantization)  # if not read as int8
        self.stages = build_stages(
            self.run_arch, host_params, self.mesh, self.dtype, self.attention_backend,
            self.config.attention_interpret, quantization, self.config.cache_config.cache_dtype,
        )
        self.weight_bytes = sum(param_bytes(st.params) for st in self.stages)
        self.int8_matmul = int8_matmul_path(quantization, self.platform, tp)
        self.timings["load_s"] = time.perf_counter() - t0

    def _read_weights(self, tp: int) -> tuple[ArchConfig, Any]:
        """Host NumPy weights; or, for an Orbax checkpoint that needs no head padding and
        no pipeline split, device arrays restored straight into their shardings."""
        files, pc = self.model_files, self.config.parallel_config
        quantized = self.config.model_config.quantization is not None
        if files.format == ModelFormat.ORBAX and pc.pipeline_parallel_size == 1 and not quantized:
            arch = read_orbax_arch(files.path)
            lay = head_layout(arch, tp)
            if lay.num_kv_heads == arch.num_key_value_heads:
                shardings = param_shardings(orbax_param_shapes(files.path), self.mesh)
                return arch, restore_orbax(files.path, self.dtype, shardings)
        # Heads are padded / replicated for tp on float weights; otherwise int8 weights are
        # read as int8, one tensor at a time.
        read_as_int8 = quantized and not _needs_head_adaptation(files, tp)
        return load_checkpoint(files, self.dtype, self.config.model_config.quantization if read_as_int8 else None)

    def page_bytes(self) -> int:
        """Bytes of one KV page on the busiest device: its stage's layers, its share of heads."""
        layers = max(b - a for a, b in (st.layers for st in self.stages))
        per_layer = self.run_arch.kv_bytes_per_token(jnp.dtype(self.kv_dtype).itemsize) // self.run_arch.num_hidden_layers
        tokens = self.config.cache_config.block_size
        return per_layer * layers * tokens // self.config.parallel_config.tensor_parallel_size

    def determine_num_blocks(self) -> int:
        """How many KV pages fit the memory budget (page 0 included, as the null page)."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        else:
            num_blocks = self._available_kv_bytes() // self.page_bytes()
        bs = cc.block_size
        need = -(-self.max_model_len // bs) + 1
        if num_blocks < need:
            fits = max(num_blocks - 1, 0) * bs
            raise ValueError(
                f"the KV cache has room for {num_blocks} pages of {bs} tokens, but one request of "
                f"max_model_len={self.max_model_len} needs {need}: the largest max_model_len that "
                f"fits is {fits}; lower --max-model-len or raise the KV cache memory"
            )
        return int(num_blocks)

    def _available_kv_bytes(self) -> int:
        cc = self.config.cache_config
        if cc.kv_cache_memory_bytes is not None:
            return cc.kv_cache_memory_bytes
        stats = self.mesh.devices.flat[0].memory_stats() if self.platform != "cpu" else None
        if not stats:
            return DEFAULT_CPU_KV_CACHE_BYTES
        # Weights are resident already; keep a margin for the largest step's activations
        # (hidden states and logits of the largest buckets, a few times over).
        sc = self.config.scheduler_config
        itemsize = jnp.dtype(self.dtype).itemsize
        activations = 8 * sc.max_num_batched_tokens * (
            self.arch.hidden_size + self.arch.intermediate_size + self.arch.q_size
        ) * itemsize + 4 * max(sc.max_num_seqs, _max_verify_rows(self.config)) * self.arch.vocab_size * 4
        budget = int(stats["bytes_limit"] * cc.gpu_memory_utilization)
        return max(budget - int(stats["bytes_in_use"]) - activations, 0)

    def initialize_cache(self, num_blocks: int) -> None:
        cc, sc = self.config.cache_config, self.config.scheduler_config
        for st in self.stages:
            shape = kv_cache_shape(st.model.cfg, num_blocks, cc.block_size)
            sharding = kv_cache_sharding(st.mesh, shape)
            st.kv_cache = jax.jit(lambda: jnp.zeros(shape, self.kv_dtype), out_shardings=sharding)()
        self.num_blocks = num_blocks
        self.runner = ModelRunner(
            self.stages,
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
            record_sampled=not (sc.async_scheduling and self.config.num_microbatches == 1),
        )

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
