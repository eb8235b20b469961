"""Assemble one engine core in this process: worker (JAX) + scheduler + EngineCore.

Used by the offline `LLM` and by the engine-core process of the server.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from jaxserve.config import EngineConfig, ResolvedConfig
from jaxserve.engine.resolve import resolve_engine_config
from jaxserve.engine_core.core import EngineCore
from jaxserve.engine_core.scheduler import Scheduler
from jaxserve.engine_core.structured_output import StructuredOutputManager
from jaxserve.models.model_files import release_gguf_readers, resolve_model
from jaxserve.models.tokenizer import load_tokenizer
from jaxserve.parallel.distributed import LeaderWorker, run_follower
from jaxserve.worker.worker import Worker

logger = logging.getLogger(__name__)


@dataclass
class BuiltEngine:
    core: EngineCore
    worker: Worker
    config: EngineConfig  # resolved (jaxserve/engine/resolve.py)
    num_blocks: int
    timings: dict[str, float]

    @property
    def resolved(self) -> ResolvedConfig:
        """The settings resolution decided (always set on a built engine's config)."""
        return resolved_of(self.config)


def resolved_of(config: EngineConfig) -> ResolvedConfig:
    """`config.resolved`, which resolve_engine_config sets; a bug if it did not run."""
    if config.resolved is None:
        raise RuntimeError("the engine config was not resolved (resolve_engine_config)")
    return config.resolved


def build_worker(config: EngineConfig) -> tuple[Worker, EngineConfig, int]:
    """Resolve, load, size, allocate and compile: every process of a multi-host engine does
    this. Returns the worker, the resolved config and the number of KV pages."""
    files = resolve_model(config.model_config.model, config.model_config.hf_overrides)
    config = resolve_engine_config(config, files)
    worker = Worker(config, files)
    worker.load_model()
    release_gguf_readers()  # the weights are read: nothing parses the file again
    logger.info("loaded %s (%s) in %.1f s: weights %.1f MiB (%s)", files.name, files.path,
                worker.timings["load_s"], worker.weight_bytes / 2**20,
                worker.weight_format.quantization or np.dtype(worker.dtype).name)
    resolved = resolved_of(config)
    if config.model_config.quantization is None and worker.platform == "cpu":
        logger.info("weights: %s", resolved.weight_format_reason)
    if resolved.experts_weight_format_reason:
        logger.info("experts: %s", resolved.experts_weight_format_reason)
    if worker.weight_matmul:
        logger.info("%s matmul: %s", worker.weight_format.quantization, worker.weight_matmul)
    num_blocks = worker.determine_num_blocks()
    worker.initialize_cache(num_blocks)
    cc = config.cache_config
    layout = worker.kv_layout
    logger.info(
        "KV cache: %d pages of %d tokens (%.2f GiB, %s values%s; %s)", num_blocks,
        cc.block_size, num_blocks * worker.page_bytes() / 2**30, layout.dtype,
        ", packed in int32 words" if layout.packed else "",
        resolved.kv_cache_groups.describe(),
    )
    if worker.num_state_slots:
        logger.info("linear-attention states: %d slots (%.2f GiB, slot 0 the null one) for %d "
                    "linear layers", worker.num_state_slots, worker.state_pool_bytes() / 2**30,
                    len(worker.arch.linear_layers))
    worker.compile_or_warm_up()
    if "compile_s" in worker.timings:
        logger.info("compiled all buckets in %.1f s", worker.timings["compile_s"])
    return worker, config, num_blocks


def build_engine_core(config: EngineConfig, eos_token_id: int | None) -> BuiltEngine:
    """Build the worker, then hand its num_blocks to a new Scheduler (process 0 only)."""
    t0 = time.perf_counter()
    worker, config, num_blocks = build_worker(config)
    if worker.distributed.process_id != 0:
        raise RuntimeError("only process 0 runs the engine core; others call run_follower_process")
    # Grammars must see the same tokens as the API server's tokenizer (--tokenizer).
    tokenizer = config.model_config.tokenizer or config.model_config.model
    structured = StructuredOutputManager(
        None if config.model_config.skip_tokenizer_init else (lambda: load_tokenizer(tokenizer)),
        worker.arch.vocab_size,
        config.structured_outputs_config.disable_additional_properties)
    scheduler = Scheduler(config.scheduler_config, config.cache_config, num_blocks, eos_token_id,
                          structured, config.speculative_config,
                          resolved_of(config).kv_cache_groups, worker.num_state_slots)
    executor = LeaderWorker(worker) if worker.distributed.num_processes > 1 else worker
    core = EngineCore(scheduler, executor, batch_queue_size=config.batch_queue_size,
                      request_tracing=config.request_tracing)
    timings = dict(worker.timings, total_s=time.perf_counter() - t0)
    return BuiltEngine(core, worker, config, num_blocks, timings)


def run_follower_process(config: EngineConfig) -> int:
    """Processes 1..N-1 of a multi-host engine: build the same worker, then execute
    every step process 0 broadcasts, until it shuts down. Returns the step count."""
    worker, _, _ = build_worker(config)
    return run_follower(worker)
