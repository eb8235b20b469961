"""The resolution stage: every setting that depends on the devices or the checkpoint, decided
once in the engine process, before the worker is built.

    EngineArgs ─create_engine_config─▶ EngineConfig (flags checked; JAX-free, any process)
        ─resolve_engine_config─▶ EngineConfig with `resolved` (platform, dtype, weight format,
                                 attention backend, max_model_len, KV cache dtype)
        ─▶ Worker, Scheduler, READY

The worker and the model read `config.resolved` and decide nothing; the API server receives the
same record in the ready message (jaxserve/engine/messages.py: EngineReady).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

import kernels_pallas
import kernels_pallas.bf16_matmul as bf16_kernel
from jaxserve.classifier import ClassifierConfig, is_classifier_architecture
from jaxserve.config import (
    CPU_AUTO_BF16_ENV,
    CacheConfig,
    EngineConfig,
    KVCacheDtype,
    ModelConfig,
    ParallelConfig,
    ResolvedConfig,
    WeightFormat,
)
from jaxserve.kv_cache_spec import KVCacheGroups
from jaxserve.models import ArchConfig, checkpoint_quant
from jaxserve.models.loaders import read_arch
from jaxserve.models.loaders.weights import projection_shapes
from jaxserve.models.model_files import ModelFiles, ModelFormat, read_hf_config, resolve_model
from jaxserve.models.moe import check_experts_split
from jaxserve.models.quantization import check_experts
from jaxserve.parallel.distributed import initialize_distributed
from jaxserve.parallel.pipeline import split_layers
from jaxserve.parallel.sharding import head_layout
from jaxserve.platforms import select_jax_platforms


def resolve_classifier(files: ModelFiles, arch: ArchConfig, mc: ModelConfig) -> ClassifierConfig | None:
    """A sequence classifier's head from its config.json (and --hf-overrides); None for a
    generative model. Tokens named by `classifier_from_token` are looked up in the tokenizer."""
    if not is_classifier_architecture(arch.architecture):
        return None
    cfg = read_hf_config(files.path, files.hf_overrides)
    token_ids = None
    if cfg.get("classifier_from_token") is not None:
        from jaxserve.models.tokenizer import load_tokenizer

        vocab = load_tokenizer(mc.tokenizer or files).get_vocab()
        token_ids = vocab.get  # not convert_tokens_to_ids: it answers <unk>'s id for a stranger
    try:
        return ClassifierConfig.from_hf_config(cfg, token_ids)
    except ValueError as e:
        raise ValueError(f"{files.path}: {e}") from None


# Tokens between the linear-attention states --mamba-cache-mode align keeps (a multiple of the
# page): a kept state costs one slot of every linear layer's states (a Qwen3-Next-80B-A3B slot
# is 36 layers x ~1 MiB), so far fewer are kept than pages.
MAMBA_BLOCK_SIZE = 256


def resolve_state_block_size(cc: CacheConfig) -> int:
    """Tokens between the linear-attention states kept for the prefix cache (0: none kept):
    --mamba-cache-mode (default align with prefix caching) and --mamba-block-size."""
    mode = cc.mamba_cache_mode or ("align" if cc.enable_prefix_caching else "none")
    if mode == "all":
        raise ValueError("--mamba-cache-mode all (a state kept at every page) is not supported; "
                         "use align (a state every --mamba-block-size tokens) or none")
    if mode == "none":
        return 0
    if not cc.enable_prefix_caching:
        raise ValueError("--mamba-cache-mode align keeps states for the prefix cache: it needs "
                         "--enable-prefix-caching")
    size = cc.mamba_block_size or max(MAMBA_BLOCK_SIZE, cc.block_size)
    if size % cc.block_size:
        raise ValueError(f"--mamba-block-size {size} must be a multiple of --block-size "
                         f"{cc.block_size}")
    return size


def resolve_kv_cache_groups(arch: ArchConfig, hybrid: bool, cc: CacheConfig) -> KVCacheGroups:
    """The model's KV cache groups: its sliding-window layers apart from its full-attention
    ones; a Gated DeltaNet hybrid's linear layers in a recurrent-state group. Not `hybrid`
    (pipeline stages, or --disable-hybrid-kv-cache-manager): layers of both attention kinds
    share one full-attention group, every page kept."""
    if arch.linear_attention is not None:
        return KVCacheGroups.for_linear_hybrid(arch.attention_layers, arch.linear_layers,
                                               resolve_state_block_size(cc))
    types = arch.layer_types or ("sliding_attention",) * arch.num_hidden_layers
    windows = [arch.sliding_window if t == "sliding_attention" else None for t in types]
    return KVCacheGroups.for_layers(windows, hybrid)


def resolve_engine_config(config: EngineConfig, files: ModelFiles | None = None,
                          devices: list[jax.Device] | None = None) -> EngineConfig:
    """`config` with its `resolved` record, and max_model_len decided in the model and
    scheduler sections too. `devices`: the ones the engine runs on (compile-only devices for
    the preflight); default: this process's (after joining the other hosts, if any).
    ValueError names the flag for a setting these devices or this checkpoint refuse."""
    if config.resolved is not None:
        return config
    files = files or resolve_model(config.model_config.model, config.model_config.hf_overrides)
    mc, pc = config.model_config, config.parallel_config
    if devices is None:
        select_jax_platforms()  # no accelerator attached: JAX starts only its CPU backend
        initialize_distributed(pc)  # before anything touches a device
        devices = jax.devices()
    platform = devices[0].platform
    arch = read_arch(files)
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    quantization, reason = resolve_quantization(mc.quantization, mc.dtype, platform, tp, pp,
                                                lambda: arch, mc.cpu_auto_bf16)
    weight_format, group_size, act_order = WeightFormat.of(quantization), None, False
    stored = resolve_checkpoint_format(files, arch, mc.quantization, platform, tp,
                                       cpu_bf16=quantization == "bf16")
    if stored is not None and stored.weight_format is not None:
        weight_format, group_size, act_order = stored.weight_format, stored.group_size, stored.act_order
        reason = stored.reason
    elif stored is not None:
        reason = f"{reason}; {stored.reason}"
    if resolve_packed_weights(weight_format, platform, tp, pp, mc.cpu_packed_weights):
        weight_format = WeightFormat.BF16_PACKED
    refuse_contradictions(arch, weight_format, pc, config.speculative_config is not None)
    experts_format, experts_reason = resolve_experts_format(files, arch, platform, tp,
                                                            pc.enable_expert_parallel)
    max_model_len = resolve_max_model_len(mc.max_model_len, arch)
    dtype = resolve_dtype(mc.dtype, platform)
    resolved = ResolvedConfig(
        platform=platform, dtype=dtype, weight_format=weight_format, weight_format_reason=reason,
        attention_backend=resolve_attention_backend(config.attention_backend, platform,
                                                    config.attention_interpret),
        max_model_len=max_model_len,
        kv_cache_dtype=KVCacheDtype.resolve(config.cache_config.cache_dtype,
                                            auto_kv_cache_dtype(dtype, weight_format, platform)),
        weight_group_size=group_size, weight_act_order=act_order,
        classifier=resolve_classifier(files, arch, mc),
        kv_cache_groups=resolve_kv_cache_groups(
            arch, hybrid=pp == 1 and not config.scheduler_config.disable_hybrid_kv_cache_manager,
            cc=config.cache_config),
        experts_weight_format=experts_format, experts_weight_format_reason=experts_reason)
    return dataclasses.replace(
        config, resolved=resolved,
        model_config=dataclasses.replace(mc, max_model_len=max_model_len),
        scheduler_config=dataclasses.replace(config.scheduler_config, max_model_len=max_model_len))


def refuse_contradictions(arch: ArchConfig, weight_format: WeightFormat, pc: ParallelConfig,
                          speculative: bool = False) -> None:
    """Flags this checkpoint contradicts, refused here (ValueError naming the flags) rather than
    once its weights are loaded or its programs traced, where the same checks also stand."""
    if arch.linear_attention is not None:
        refuse_for_linear_hybrids(arch, weight_format, pc, speculative)
    split_layers(arch.num_hidden_layers, pc.pipeline_parallel_size)
    if arch.num_experts:
        check_experts(weight_format)
        check_experts_split(arch, pc.tensor_parallel_size, pc.enable_expert_parallel)


def refuse_for_linear_hybrids(arch: ArchConfig, weight_format: WeightFormat,
                              pc: ParallelConfig, speculative: bool = False) -> None:
    """What the Gated DeltaNet hybrids (models/qwen3_next.py) do not run with yet."""
    name = arch.architecture
    if speculative:
        # A verified step runs the draft tokens through the linear layers: a rejected draft
        # would stay in the recurrent state (no rollback yet).
        raise ValueError(f"{name}: --speculative-config is not supported for the Gated DeltaNet "
                         "hybrids yet (their recurrent state cannot take back rejected drafts)")
    if pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1:
        raise ValueError(f"{name}: --tensor-parallel-size and --pipeline-parallel-size above 1 "
                         "are not supported for the Gated DeltaNet hybrids yet")
    if weight_format is not WeightFormat.FLOAT:
        raise ValueError(f"{name}: {weight_format.value} weights are not supported for the Gated "
                         "DeltaNet hybrids yet (float only: no --quantization)")


def resolve_dtype(dtype: str, platform: str) -> str:
    """`auto` is bfloat16 on GPU/TPU and float32 on the CPU (XLA's bf16 is slower there:
    docs/benchmarks.md, "Figures the code's comments used to hold")."""
    if dtype == "auto":
        return "float32" if platform == "cpu" else "bfloat16"
    return dtype


def auto_kv_cache_dtype(dtype: str, weight_format: WeightFormat, platform: str) -> str:
    """What `--kv-cache-dtype auto` stores: the model's dtype, but bfloat16 on a CPU running
    bf16 weights. There the cache takes half float32's bytes (twice the pages), the C++
    attention kernels read it in place and the prefill's dots run on the bf16 units
    (docs/benchmarks.md, "Prefill attention in C++ and a bf16 KV cache on the CPU"); vLLM's
    CPU build keeps its bf16 model's cache in bf16 as well."""
    return "bfloat16" if platform == "cpu" and weight_format.bf16 else dtype


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
    if arch().linear_attention is not None:
        return None, "float32 weights: bf16 does not cover the Gated DeltaNet hybrids yet"
    if not bf16_kernel.cpu.onednn_available():
        return None, f"float32 weights: no native bf16 matmul ({bf16_kernel.cpu.onednn_unavailable_reason()})"
    return "bf16", (f"bf16 weights: --dtype auto on a CPU with bf16 units ({bf16_kernel.cpu.onednn_description()}; "
                    "--no-cpu-auto-bf16 or --dtype float32 keeps float32)")


@dataclasses.dataclass(frozen=True)
class CheckpointFormat:
    """How a checkpoint stored quantized is served (`resolve_checkpoint_format`)."""

    # The format that keeps its stored width; None: its weights are dequantized at load into
    # the format --quantization and the platform pick.
    weight_format: WeightFormat | None
    reason: str  # why, for the start-up log
    group_size: int | None = None  # its inputs per scale (None: one scale per channel)
    act_order: bool = False  # its inputs are permuted into their groups (GPTQ's desc_act)


def resolve_checkpoint_format(
    files: ModelFiles, arch: ArchConfig, quantization: str | None, platform: str, tp: int,
    cpu_bf16: bool = False,
) -> CheckpointFormat | None:
    """How a checkpoint stored quantized (models/checkpoint_quant.py) is served: the format
    that keeps its stored width, or none where its weights are dequantized at load, and why.
    None for a float checkpoint.

    fp8 stays 8-bit on GPU and TPU (kernels_pallas/int8_matmul widens it inside the matmul);
    the CPU has no fp8 matmul, so it is dequantized at load there. int4 stays 4-bit on TPU and
    GPU (GPU: without tensor parallelism; with zero points, AWQ's, as a `zero_scale` leaf; not
    for experts, whose matmul has none); elsewhere int values are served as int8, which holds
    them (and q - zero for int4) exactly; but on a CPU whose default is bf16 weights
    (`cpu_bf16`: resolve_quantization chose them) they are dequantized into those, its faster
    path (docs/benchmarks.md, "Checkpoints stored quantized"; --no-cpu-auto-bf16 keeps them
    exact as int8)."""
    if files.format is not ModelFormat.HF:
        return None
    cq = checkpoint_quant.from_hf_config(read_hf_config(files.path, files.hf_overrides), files.path)
    if cq is None:
        return None
    if quantization is not None:
        return CheckpointFormat(None, f"the checkpoint's {cq.name} weights dequantized at load for "
                                f"--quantization {quantization}")
    if head_layout(arch, tp).num_kv_heads != arch.num_key_value_heads:
        return CheckpointFormat(None, f"the checkpoint's {cq.name} weights dequantized at load: tensor "
                                f"parallel size {tp} pads the KV heads, which needs float weights")
    left = [n for n in projection_shapes(arch) if n != "lm_head.weight"
            and not cq.quantizes(n.removesuffix(".weight"))]
    if left:
        return CheckpointFormat(None, f"the checkpoint's {cq.name} weights dequantized at load: it leaves "
                                f"{left[0]} unquantized, and each projection is stacked over the layers")
    if cq.desc_act and (tp > 1 or arch.num_experts):
        return CheckpointFormat(None, f"the checkpoint's {cq.name} weights dequantized at load: activation "
                                "order (desc_act) permutes each projection's inputs, which tensor "
                                "parallelism and the experts' matmul do not")
    if cq.type == "int" and cq.num_bits == 8 and not cq.symmetric:
        return CheckpointFormat(None, f"the checkpoint's {cq.name} weights dequantized at load: 8-bit values "
                                "minus zero points need 9 bits")
    if cq.type == "float" and platform == "cpu":
        return CheckpointFormat(None, f"the checkpoint's {cq.name} weights dequantized at load (the CPU has "
                                "no fp8 matmul)")
    if platform == "cpu" and cpu_bf16:
        return CheckpointFormat(None, f"the checkpoint's {cq.name} weights dequantized at load into them: "
                                "faster than its int8 values on this CPU (--no-cpu-auto-bf16 keeps those, "
                                "exact)")
    # The GPU's int4 is its kernel's (one device per stage, no experts); XLA's GPU path widens
    # s4 stacks (the experts' ragged_dot included).
    int4 = cq.num_bits == 4 and (platform == "tpu" or platform == "gpu" and tp == 1
                                 and not arch.num_experts)
    fmt = (WeightFormat.CHECKPOINT_FP8 if cq.type == "float" else WeightFormat.CHECKPOINT_INT4
           if int4 and cq.symmetric else WeightFormat.CHECKPOINT_INT4_ZP
           if int4 and not arch.num_experts else WeightFormat.CHECKPOINT_INT8)
    group = (cq.group_size if cq.strategy == "group"
             else cq.block[1] if cq.strategy == "block" and cq.block is not None else None)
    order = ", inputs permuted into their groups (desc_act)" if cq.desc_act else ""
    return CheckpointFormat(fmt, f"the checkpoint's {cq.name} weights kept as {fmt.quantization} values{order}",
                            group, cq.desc_act)


def resolve_experts_format(files: ModelFiles, arch: ArchConfig, platform: str, tp: int,
                           ep: bool) -> tuple[WeightFormat | None, str]:
    """(the experts' own format, why) for a checkpoint whose experts alone are quantized:
    GPT-OSS's MXFP4 experts stay at 4 bits (FP4 values, a scale per 32 inputs) on every
    platform (GPUs: packed as stored), unless tensor parallelism without expert parallelism
    would split a down projection's 32-input groups; then they are dequantized at load
    (None)."""
    if files.format is not ModelFormat.HF or not arch.num_experts:
        return None, ""
    qc = read_hf_config(files.path, files.hf_overrides).get("quantization_config") or {}
    if qc.get("quant_method") != "mxfp4":
        return None, ""
    groups = arch.moe_intermediate_size // checkpoint_quant.MXFP4_BLOCK
    if tp > 1 and not ep and groups % tp:
        return None, (f"MXFP4 experts dequantized at load: -tp {tp} would split their "
                      f"{groups} scale groups (--enable-expert-parallel keeps them at 4 bits)")
    if platform == "gpu":
        return WeightFormat.CHECKPOINT_MXFP4_PACKED, "MXFP4 experts kept as stored (4 bits)"
    return WeightFormat.CHECKPOINT_MXFP4, "MXFP4 experts kept as FP4 values"


def resolve_packed_weights(fmt: WeightFormat, platform: str, tp: int, pp: int,
                           allowed: bool = True) -> bool:
    """Whether bf16 weights are packed at load into oneDNN's blocked layout: on a CPU where
    oneDNN's bf16 matmul is native, with one device per stage, unless not `allowed`
    (--no-cpu-packed-weights keeps them in plain [out, in] rows: the few-token AVX2 kernel and
    oneDNN with per-call repacking). Packed, every token count runs without repacking the
    weights per call, faster than the plain-row paths at every batch size measured
    (docs/benchmarks.md, "Packed bf16 weights")."""
    return (fmt.bf16 and platform == "cpu" and tp == 1 and pp == 1
            and allowed and bf16_kernel.packing_available())
