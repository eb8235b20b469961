"""Per-request pooling parameters (vLLM's `PoolingParams`): how an embedding request turns
its prompt's final hidden states into one vector.

An embedding request shares the engine with generation: the scheduler runs its prompt like
any other (prefix caching, chunked prefill, preemption), the worker pools the final-norm
hidden states of its prompt tokens chunk by chunk (jaxserve/worker/pooler.py) and the
request ends with its vector instead of a token. JAX-free.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's pooling types that jaxserve implements: the last prompt token's state (what a
# causal model's embedding models use), the mean over the prompt, or the first token's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolingParams:
    """`pooling_type`: one of POOLING_TYPES (the server's --pooler-config decides it);
    `normalize`: divide the vector by its L2 norm (vLLM's default for embeddings)."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether a prefix-cache hit may skip prompt tokens: only LAST pooling reads none
        of them but the last (which is always computed); MEAN and CLS need every state."""
        return self.pooling_type == "LAST"
