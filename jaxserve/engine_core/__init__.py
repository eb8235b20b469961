"""The engine core: scheduler, paged KV-cache manager and the step loop.

Pure Python and NumPy: this package never imports JAX, the worker or the models
(tests/test_import_rules.py checks it). The worker is reached only through the
SchedulerOutput / ModelRunnerOutput contract.
"""

from jaxserve.engine_core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from jaxserve.engine_core.core import EngineCore
from jaxserve.engine_core.core_outputs import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput
from jaxserve.engine_core.kv_cache_manager import KVCacheManager
from jaxserve.engine_core.model_runner_output import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    LogprobsLists,
    ModelRunnerOutput,
)
from jaxserve.engine_core.request import Request, RequestStatus
from jaxserve.engine_core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxserve.engine_core.scheduler import Scheduler
from jaxserve.engine_core.stats import PrefixCacheStats, SchedulerStats

__all__ = [
    "EMPTY_MODEL_RUNNER_OUTPUT",
    "BlockPool",
    "CachedRequestData",
    "EngineCore",
    "EngineCoreEvent",
    "EngineCoreEventType",
    "EngineCoreOutput",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "LogprobsLists",
    "ModelRunnerOutput",
    "NewRequestData",
    "PrefixCacheStats",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
]
