"""`EngineArgs` (vLLM's name): every engine argument, its default and its help, in one place.

The command lines (`serve`, `preflight`, `generate`, `bench throughput`) generate their engine
flags from it (`add_cli_args`); the offline `LLM(**kwargs)` takes the same names; and
`create_engine_config` resolves every derived setting, once, into the frozen `EngineConfig`.
JAX-free (the API server parses these flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from jaxserve.config import (
    CPU_AUTO_BF16_ENV,
    CPU_PACKED_WEIGHTS_ENV,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    MAMBA_CACHE_MODES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from jaxserve.weight_format import QUANTIZATION_METHODS

_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def human_readable_int(value: str) -> int:
    """`8k`/`2G` -> an int, vLLM's rule: lowercase k/m/g/t are powers of 1000, uppercase (and
    KiB/MiB/GiB/TiB) powers of 1024; kB/MB/GB decimal. Plain integers pass through."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?)([bB]?)\s*", value)
    if not m:
        raise argparse.ArgumentTypeError(f"not a number or size: {value!r} (e.g. 4096, 8k, 2GiB)")
    number, unit, binary, _ = m.groups()
    base = 1024 if binary or (unit.isupper() and not m.group(4)) else 1000
    result = float(number) * base ** _UNITS[unit.lower()]
    if result != int(result):
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number")
    return int(result)


def json_object(value: str) -> dict:
    """A JSON object (vLLM's --speculative-config form)."""
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def cli_arg(group: str, help: str, *aliases: str, cli: bool = True, **argparse_kw: Any) -> dict:
    """A field's command-line form: its argparse group, help, short aliases ("-tp") and
    add_argument keywords (type, choices, action, nargs, metavar); `cli=False` for
    arguments with no flag (read from the environment instead)."""
    return {"group": group, "help": help, "aliases": aliases, "cli": cli, "kw": argparse_kw}


BOOL = argparse.BooleanOptionalAction


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, group_prefix: str = "",
                       defaults: dict[str, Any] | None = None, exclude: tuple[str, ...] = ()
                       ) -> argparse.ArgumentParser:
    """A flag per field of `cls` whose metadata is an `cli_arg(...)` (EngineArgs, ServerArgs):
    `--field-name`, its aliases, default and help, in the field's argparse group."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta["cli"] or f.name in exclude:
            continue
        name = meta["group"]
        if name not in groups:
            groups[name] = parser.add_argument_group(group_prefix + name)
        default = (defaults or {}).get(f.name, f.default)
        groups[name].add_argument("--" + f.name.replace("_", "-"), *meta["aliases"],
                                  dest=f.name, default=default, help=meta["help"], **meta["kw"])
    return parser


@dataclass
class EngineArgs:
    """The engine's arguments under vLLM's names; `create_engine_config()` validates them.
    A default that a config section also has is that section's (one place for each)."""

    # model
    model: str | None = field(default=None, metadata=cli_arg(
        "model", "HF directory or .gguf file; None: SmolLM2-135M-Instruct, bundled"))
    served_model_name: str | list[str] | None = field(default=None, metadata=cli_arg(
        "model", "model name(s) the API accepts; the first is reported (default: from --model)",
        nargs="+"))
    tokenizer: str | None = field(default=None, metadata=cli_arg(
        "model", "HF directory or .gguf file of the tokenizer, if not the model's"))
    dtype: str = field(default=ModelConfig.dtype, metadata=cli_arg(
        "model", "weights and activations (auto: bfloat16 on GPU/TPU; on the CPU float32, with "
        "bfloat16 weights (as --quantization bf16) for dense models where the CPU has AVX512-BF16 "
        "or AMX)",
        choices=["auto", "float32", "bfloat16", "float16"]))
    max_model_len: int | None = field(default=None, metadata=cli_arg(
        "model", "context length (default: the model's)", type=human_readable_int))
    quantization: str | None = field(default=None, metadata=cli_arg(
        "model", "weight-only, converted at load from any checkpoint: int8 (per-channel int8 "
        "weights) or bf16 (bfloat16 weights; on the CPU oneDNN's bf16 matmul); activations stay "
        "float32 on the CPU", "-q", choices=list(QUANTIZATION_METHODS)))
    load_format: str = field(default=ModelConfig.load_format, metadata=cli_arg(
        "model", "dummy: random weights of the model's shapes (its config.json alone "
        "suffices), for benchmarks and device checks", choices=list(LOAD_FORMATS)))
    skip_tokenizer_init: bool = field(default=ModelConfig.skip_tokenizer_init, metadata=cli_arg(
        "model", "load no tokenizer (a checkpoint without one): prompts are token ids, outputs "
        "token ids only", action="store_true"))
    hf_overrides: dict | None = field(default=None, metadata=cli_arg(
        "model", "keys laid over the checkpoint's config.json, e.g. Qwen3-Reranker as a "
        "classifier: '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
        "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}'",
        type=json_object, metavar="JSON"))
    seed: int = field(default=ModelConfig.seed, metadata=cli_arg(
        "model", "engine seed (requests without a seed derive theirs from it)", type=int))
    cpu_auto_bf16: bool | None = field(default=None, metadata=cli_arg(
        "model", "on a CPU with bf16 units (AVX512-BF16, AMX), --dtype auto gives dense models "
        "bf16 weights; --no-cpu-auto-bf16 keeps float32 (default: yes, unless "
        f"${CPU_AUTO_BF16_ENV}=0)", action=BOOL))
    cpu_packed_weights: bool | None = field(default=None, metadata=cli_arg(
        "model", "on such a CPU, bf16 weights are packed at load into oneDNN's blocked layout; "
        f"--no-cpu-packed-weights keeps plain rows (default: yes, unless "
        f"${CPU_PACKED_WEIGHTS_ENV}=0)", action=BOOL))
    # cache
    block_size: int = field(default=CacheConfig.block_size, metadata=cli_arg(
        "cache", "tokens per KV-cache page", type=int))
    gpu_memory_utilization: float = field(default=CacheConfig.gpu_memory_utilization, metadata=cli_arg(
        "cache", "fraction of accelerator memory for weights, activations and KV cache",
        type=float))
    kv_cache_memory_bytes: int | None = field(default=None, metadata=cli_arg(
        "cache", "KV-cache budget in bytes, e.g. 2GiB (None: on the CPU 2 GiB, elsewhere "
        "--gpu-memory-utilization of the device)", type=human_readable_int))
    kv_cache_dtype: str = field(default=CacheConfig.cache_dtype, metadata=cli_arg(
        "cache", "KV cache values: auto (the model's dtype), bfloat16, or fp8 (= fp8_e4m3) / "
        "fp8_e5m2, one byte each (k_scale = v_scale = 1.0)", choices=list(KV_CACHE_DTYPES)))
    num_gpu_blocks_override: int | None = field(default=None, metadata=cli_arg(
        "cache", "KV-cache pages, overriding the memory budget", type=int))
    enable_prefix_caching: bool = field(default=CacheConfig.enable_prefix_caching, metadata=cli_arg(
        "cache", "reuse KV pages of shared prompt prefixes", action=BOOL))
    mamba_cache_mode: str | None = field(default=None, metadata=cli_arg(
        "cache", "linear-attention (Gated DeltaNet) states: align keeps each request's state "
        "every --mamba-block-size tokens for the prefix cache, none only its running one "
        "(default: align with prefix caching, else none; all is not supported)",
        choices=list(MAMBA_CACHE_MODES)))
    mamba_block_size: int | None = field(default=None, metadata=cli_arg(
        "cache", "tokens between the linear-attention states align keeps, a multiple of "
        "--block-size (default 256)", type=int))
    # scheduler
    max_num_seqs: int = field(default=SchedulerConfig.max_num_seqs, metadata=cli_arg(
        "scheduler", "most requests in the running batch", type=int))
    max_num_batched_tokens: int = field(default=SchedulerConfig.max_num_batched_tokens, metadata=cli_arg(
        "scheduler", "most tokens in one step (chunked prefill splits longer prompts)",
        type=human_readable_int))
    async_scheduling: bool = field(default=SchedulerConfig.async_scheduling, metadata=cli_arg(
        "scheduler", "schedule step N+1 while step N runs (off with speculative decoding)",
        action=BOOL))
    disable_hybrid_kv_cache_manager: bool = field(
        default=SchedulerConfig.disable_hybrid_kv_cache_manager, metadata=cli_arg(
            "scheduler", "sliding-window layers keep every page, as full attention does "
            "(one KV cache group)", action=BOOL))
    scheduling_policy: str = field(default=SchedulerConfig.policy.value, metadata=cli_arg(
        "scheduler", "order of the waiting queue", choices=[p.value for p in SchedulingPolicy]))
    speculative_config: dict | SpeculativeConfig | None = field(default=None, metadata=cli_arg(
        "scheduler", 'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens":'
        ' 4}\' (keys: prompt_lookup_max, prompt_lookup_min, disable_by_batch_size); turns off '
        "async scheduling", type=json_object, metavar="JSON"))
    structured_outputs_config: dict | StructuredOutputsConfig | None = field(
        default=None, metadata=cli_arg(
            "scheduler", 'structured outputs, e.g. \'{"disable_additional_properties": true}\' '
            "(JSON schemas' objects without additionalProperties get false); the backend is "
            "llguidance", type=json_object, metavar="JSON"))
    pooler_config: dict | PoolerConfig | None = field(default=None, metadata=cli_arg(
        "model", 'embeddings (/v1/embeddings, LLM.embed), e.g. \'{"pooling_type": "MEAN", '
        '"normalize": false}\' (pooling_type LAST, MEAN or CLS; default LAST, normalized)',
        "--override-pooler-config", type=json_object, metavar="JSON"))
    # parallel
    tensor_parallel_size: int = field(default=ParallelConfig.tensor_parallel_size, metadata=cli_arg(
        "parallel", "devices each layer is split over", "-tp", type=int))
    pipeline_parallel_size: int = field(default=ParallelConfig.pipeline_parallel_size, metadata=cli_arg(
        "parallel", "stages the layers are split into", "-pp", type=int))
    enable_expert_parallel: bool = field(default=ParallelConfig.enable_expert_parallel, metadata=cli_arg(
        "parallel", "mixture of experts: split the experts over the tensor-parallel devices "
        "(E / tp whole experts each) instead of every expert's columns", action="store_true"))
    data_parallel_size: int = field(default=ParallelConfig.data_parallel_size, metadata=cli_arg(
        "parallel", "engine-core processes, each with its own devices, KV cache and scheduler",
        "-dp", type=int))
    distributed_coordinator_address: str | None = field(default=None, metadata=cli_arg(
        "parallel", "multi-host coordinator (default: $JAX_COORDINATOR_ADDRESS)", cli=False))
    distributed_num_processes: int | None = field(default=None, metadata=cli_arg(
        "parallel", "multi-host processes (default: $JAX_NUM_PROCESSES)", cli=False))
    distributed_process_id: int | None = field(default=None, metadata=cli_arg(
        "parallel", "this host's process (default: $JAX_PROCESS_ID)", cli=False))
    # worker
    enforce_eager: bool = field(default=EngineConfig.enforce_eager, metadata=cli_arg(
        "worker", "skip compiling the buckets at start-up (compile lazily)", action="store_true"))
    attention_backend: str = field(default=EngineConfig.attention_backend, metadata=cli_arg(
        "worker", "attention kernel variant: auto (the platform's own: cpu, gpu or tpu), "
        "reference, or any registered variant"))
    attention_interpret: bool = field(default=EngineConfig.attention_interpret, metadata=cli_arg(
        "worker", "run Pallas attention variants in interpret mode (tests, research)",
        action="store_true"))
    request_tracing: bool = field(default=EngineConfig.request_tracing, metadata=cli_arg(
        "worker", "trace each request box by box (/debug); --no-request-tracing turns it off",
        action=BOOL))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """`LLM(model, **kwargs)`'s arguments; an unknown name is a ValueError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; see jaxserve/engine/"
                             "arg_utils.py (EngineArgs) for the ones jaxserve takes")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None,
                     exclude: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        """Add every engine flag (`--max-num-seqs`, ...) to `parser`, in one argparse group
        per box; `defaults` overrides a default for this command line (its --help shows it)."""
        return add_dataclass_args(parser, cls, "engine: ", defaults, exclude)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The parsed flags (arguments a command line leaves out keep their defaults)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                      if hasattr(args, f.name)})

    def create_engine_config(self) -> EngineConfig:
        """Validate and resolve into the frozen EngineConfig (ValueError naming the field).
        Every derived setting is decided here (every process of a multi-host engine builds
        the same one)."""
        spec = self.speculative_config
        if isinstance(spec, dict):
            spec = SpeculativeConfig.from_dict(spec)
        so = self.structured_outputs_config or StructuredOutputsConfig()
        if isinstance(so, dict):
            so = StructuredOutputsConfig.from_dict(so)
        pooler = self.pooler_config or PoolerConfig()
        if isinstance(pooler, dict):
            pooler = PoolerConfig.from_dict(pooler)
        # A step's accepted count decides the next step's inputs (vLLM V1 first shipped
        # speculation without async scheduling too).
        async_scheduling = self.async_scheduling and spec is None
        # With pipeline stages, async scheduling becomes pp microbatches: steps with requests
        # of their own overlap across the stages (feeding a step the previous one's tokens
        # would chain them).
        pp = self.pipeline_parallel_size
        num_microbatches = pp if pp > 1 and async_scheduling else 1
        if num_microbatches > 1:
            async_scheduling = False
        name = self.served_model_name
        served = (name,) if isinstance(name, str) else tuple(name or ())
        return EngineConfig(
            model_config=ModelConfig(
                model=self.model, dtype=self.dtype, max_model_len=self.max_model_len,
                seed=self.seed, served_model_name=served, tokenizer=self.tokenizer,
                quantization=self.quantization, load_format=self.load_format,
                skip_tokenizer_init=self.skip_tokenizer_init,
                hf_overrides=json.dumps(self.hf_overrides) if self.hf_overrides else None,
                cpu_auto_bf16=_flag_or_env(self.cpu_auto_bf16, CPU_AUTO_BF16_ENV),
                cpu_packed_weights=_flag_or_env(self.cpu_packed_weights, CPU_PACKED_WEIGHTS_ENV)),
            cache_config=CacheConfig(
                block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                cache_dtype=self.kv_cache_dtype, mamba_cache_mode=self.mamba_cache_mode,
                mamba_block_size=self.mamba_block_size),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len,  # None: the model's (engine/resolve.py)
                policy=_policy(self.scheduling_policy), async_scheduling=async_scheduling,
                num_microbatches=num_microbatches,
                disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager),
            parallel_config=ParallelConfig(
                self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size,
                distributed_coordinator_address=self.distributed_coordinator_address,
                distributed_num_processes=self.distributed_num_processes,
                distributed_process_id=self.distributed_process_id,
                enable_expert_parallel=self.enable_expert_parallel),
            enforce_eager=self.enforce_eager, attention_backend=self.attention_backend,
            attention_interpret=self.attention_interpret, request_tracing=self.request_tracing,
            speculative_config=spec, structured_outputs_config=so, pooler_config=pooler)


def _flag_or_env(flag: bool | None, env: str) -> bool:
    """A yes/no flag: as given, else the environment's "0" says no, else yes (the documented
    overrides are read here only, into the same EngineConfig field)."""
    return flag if flag is not None else os.environ.get(env, "1") != "0"


def _policy(value: str) -> SchedulingPolicy:
    try:
        return SchedulingPolicy(value)
    except ValueError:
        raise ValueError(f"scheduling_policy must be one of "
                         f"{', '.join(p.value for p in SchedulingPolicy)}, got {value!r}") from None


def make_engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """`EngineArgs(model=model, **kwargs).create_engine_config()`, for code and tests that
    build a config from keywords."""
    return EngineArgs.from_kwargs(model=model, **kwargs).create_engine_config()


def engine_arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A command line of the engine (serve, preflight): the model as a positional argument
    (`vllm serve MODEL`'s form); the caller adds its own flags, then the engine's."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (same as --model)")
    return p


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the frozen EngineConfig from an engine_arg_parser's flags (raises ValueError
    naming the bad flag's field)."""
    engine_args = EngineArgs.from_cli_args(args)
    tag = getattr(args, "model_tag", None)  # MODEL, positional: the same setting as --model
    if tag is not None:
        if engine_args.model is not None and engine_args.model != tag:
            raise ValueError(f"two models given: {tag!r} and --model {engine_args.model!r}")
        engine_args = dataclasses.replace(engine_args, model=tag)
    return engine_args.create_engine_config()
