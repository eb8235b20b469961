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
# vLLM's pooling tasks that jaxserve serves: a vector per prompt (embed), a classifier's
# probabilities (classify) or a pair's score (score; both need a classifier head,
# jaxserve/classifier.py), or one vector per prompt token (token_embed).
POOLING_TASKS = ("embed", "classify", "score", "token_embed")


@dataclass(frozen=True)
class PoolingParams:
    """`pooling_type`: one of POOLING_TYPES (the server's --pooler-config decides it;
    classify and score pool the last token, token_embed every one); `normalize`: apply the
    task's activation (vLLM's `use_activation`): the L2 norm of each vector for embed and
    token_embed, the classifier's activation for classify and score."""

    pooling_type: str = "LAST"
    normalize: bool = True
    task: str = "embed"

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.task in ("classify", "score") and self.pooling_type != "LAST":
            raise ValueError(f"the {self.task} task pools the last token, not {self.pooling_type}")

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether a prefix-cache hit may skip prompt tokens: only LAST pooling reads none
        of them but the last (which is always computed); MEAN, CLS and token_embed need
        every state."""
        return self.pooling_type == "LAST" and self.task != "token_embed"
