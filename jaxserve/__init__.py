"""jaxserve: vLLM V1's serving architecture in JAX and Pallas.

`from jaxserve import LLM, SamplingParams` loads JAX lazily, so the API server
and the engine core can import `jaxserve.*` modules without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxserve.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxserve.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    raise AttributeError(name)
