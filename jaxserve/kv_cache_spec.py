"""Which layers share a block table: the KV cache groups (vLLM's `KVCacheSpec` and
`KVCacheGroupSpec`), decided once from the model's layer kinds.

Every page of the pool has the same size: one token block of `num_slots` layers. A group is
`num_slots` layers of one kind; a page handed to a group holds those layers' K/V, slot i for
the group's i-th layer. Gemma-3-4B (5 full layers, 29 sliding ones, window 1024) at 32k:

    cache [num_slots=5, num_pages, page_size, ...]      (was [34 layers, num_pages, ...])
    group 0  full      layers 5 11 17 23 29   2048 pages per request
    group 1  sliding   layers 0 1 2 3 4          65 pages per request (its window)
    ...
    group 6  sliding   layers 30 31 32 33 (-)    65 (slot 4 unused)

A sliding group keeps only the pages its window can still read
(engine_core/single_type_kv_cache_manager.py), so the pages a long request holds fall from
layers x context to about slots x (context + groups x window). Models whose layers are all alike have one group with one slot per layer, the cache
as it always was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One block table's layers (slot i holds `layers[i]`) and what they keep: attention
    K/V pages over the context or its sliding window, or a recurrent state (vLLM's
    MambaSpec: linear-attention layers' convolution and delta-rule states)."""

    layers: tuple[int, ...]
    sliding_window: int | None = None  # None: full attention (vLLM's FullAttentionSpec)
    # A recurrent group's table holds state slots of a pool of their own, not pages: one
    # entry per `state_block_size` tokens (a multiple of the page; vLLM's mamba_block_size),
    # the state after that block's last token, kept for the prefix cache. 0: no states are
    # kept but the request's own (vLLM's --mamba-cache-mode none).
    recurrent: bool = False
    state_block_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))  # a list off the wire
        if self.recurrent and self.sliding_window is not None:
            raise ValueError("a recurrent-state group has no sliding window")
        if self.state_block_size and not self.recurrent:
            raise ValueError("state_block_size is a recurrent-state group's")

    @property
    def kind(self) -> str:
        if self.recurrent:
            return "recurrent_state"
        return "full_attention" if self.sliding_window is None else "sliding_window"

    def max_pages(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Pages one request of `num_tokens` holds at most while computing `chunk` tokens a
        step: every page for full attention; for a sliding window the pages covering the
        window before the step's first token and the step's own tokens; none for a
        recurrent state (its slots are `max_state_slots`)."""
        every = cdiv(num_tokens, block_size)
        if self.recurrent:
            return 0
        if self.sliding_window is None:
            return every
        return min(every, cdiv(self.sliding_window - 1 + chunk, block_size) + 1)

    def max_state_slots(self) -> int:
        """State slots one running request holds at most: the state it reads and, in a step
        that starts a new state block, the one it writes (the other stays cached)."""
        return (2 if self.state_block_size else 1) if self.recurrent else 0  # at most


@dataclass(frozen=True)
class KVCacheGroups:
    """The groups of one engine's cache (a frozen, hashable setting: it travels in
    ResolvedConfig to the scheduler, the worker and the model)."""

    groups: tuple[KVCacheGroupSpec, ...]
    # Layers per group, the cache's first axis; None: one group, one slot per layer of the
    # stage (every pipeline stage its own layers).
    num_slots: int | None = None

    @classmethod
    def for_layers(cls, windows: Sequence[int | None], hybrid: bool = True) -> KVCacheGroups:
        """Groups for layers whose windows are `windows` (None: full attention). Layers of two
        kinds get groups of the rarer kind's count (vLLM's uniform page size), unless `hybrid`
        is False: then every layer keeps every page in one full-attention group."""
        kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
        layers = tuple(range(len(windows)))
        if len(kinds) == 1:
            return cls((KVCacheGroupSpec(layers, kinds[0]),))
        if not hybrid:
            return cls((KVCacheGroupSpec(layers, None),))
        by_kind = [[i for i, w in enumerate(windows) if w == k] for k in kinds]
        size = min(len(ls) for ls in by_kind)
        groups = tuple(KVCacheGroupSpec(tuple(ls[i : i + size]), k)
                       for k, ls in zip(kinds, by_kind) for i in range(0, len(ls), size))
        return cls(groups, size)

    @classmethod
    def for_linear_hybrid(cls, attention_layers: Sequence[int], linear_layers: Sequence[int],
                          state_block_size: int) -> KVCacheGroups:
        """A Gated DeltaNet hybrid's groups: one full-attention group of its attention layers
        (slot i: the i-th) and one recurrent group of its linear layers (slot i: the i-th, its
        index in the state arrays), keeping states every `state_block_size` tokens (0: none)."""
        return cls((KVCacheGroupSpec(tuple(attention_layers)),
                    KVCacheGroupSpec(tuple(linear_layers), recurrent=True,
                                     state_block_size=state_block_size)),
                   num_slots=len(attention_layers))

    def recurrent_group(self) -> int | None:
        """The recurrent group's index (None: the model has none)."""
        return next((g for g, spec in enumerate(self.groups) if spec.recurrent), None)

    def num_state_slots(self, max_num_seqs: int) -> int:
        """The state pool's slots (0: no recurrent group): the null slot, each running request's
        at most, and as many again for the states kept for the prefix cache when states are
        kept (the pool's LRU evicts the oldest kept state first)."""
        per_request = self.state_slots_per_request()
        if not per_request:
            return 0
        keeps = any(g.recurrent and g.state_block_size for g in self.groups)
        return 1 + max_num_seqs * per_request * (2 if keeps else 1)

    @property
    def hybrid(self) -> bool:
        return self.num_slots is not None

    @property
    def has_sliding(self) -> bool:
        return any(g.sliding_window is not None for g in self.groups)

    @property
    def has_recurrent(self) -> bool:
        return any(g.recurrent for g in self.groups)

    def state_slots_per_request(self) -> int:
        """State slots (of every recurrent group) one running request holds at most."""
        return sum(g.max_state_slots() for g in self.groups)

    def layer_group_slot(self, num_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Each layer's group and slot (for one group: group 0, slot = the layer)."""
        if not self.hybrid:
            return (0,) * num_layers, tuple(range(num_layers))
        group, slot = [0] * num_layers, [0] * num_layers
        for g, spec in enumerate(self.groups):
            for s, layer in enumerate(spec.layers):
                group[layer], slot[layer] = g, s
        return tuple(group), tuple(slot)

    def slots(self, num_layers: int) -> int:
        """The cache's first axis for a stage of `num_layers` layers."""
        return num_layers if self.num_slots is None else self.num_slots

    def pages_per_request(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Pages (of every group) one request of `num_tokens` holds at most, computing `chunk`
        tokens a step (1: decoding)."""
        return sum(g.max_pages(num_tokens, block_size, chunk) for g in self.groups)

    def min_num_blocks(self, max_model_len: int, block_size: int, chunk: int) -> int:
        """The smallest cache the engine accepts: one max_model_len request computing up to
        `chunk` tokens a step, and the null page (so a request alone can always grow to
        max_model_len, and preemption never livelocks)."""
        return self.pages_per_request(max_model_len, block_size, chunk) + 1

    def longest_fitting(self, num_blocks: int, block_size: int, chunk: int) -> int:
        """The largest max_model_len whose min_num_blocks is at most `num_blocks` (0: none)."""
        lo, hi = 0, 1 << 26
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.min_num_blocks(mid, block_size, chunk) <= num_blocks \
                else (lo, mid - 1)
        return lo

    def check_holds(self, num_blocks: int, max_model_len: int, block_size: int,
                    chunk: int) -> None:
        """ValueError, naming the flags, for a cache smaller than min_num_blocks."""
        need = self.min_num_blocks(max_model_len, block_size, chunk)
        if num_blocks < need:
            raise ValueError(
                f"the KV cache holds {num_blocks - 1} pages of {block_size} tokens but one "
                f"request of --max-model-len {max_model_len} needs {need - 1} "
                f"({self.describe()}); lower --max-model-len or give the KV cache more memory")

    def describe(self) -> str:
        if len(self.groups) == 1:
            g = self.groups[0]
            return ("one group, full attention" if g.sliding_window is None
                    else f"one group, sliding window {g.sliding_window}")
        counts: dict[str, int] = {}
        for g in self.groups:
            name = {"full_attention": "full attention", "recurrent_state": "recurrent state",
                    "sliding_window": f"sliding window {g.sliding_window}"}[g.kind]
            counts[name] = counts.get(name, 0) + 1
        return (f"{len(self.groups)} groups of {self.num_slots} layers: "
                + ", ".join(f"{n} {name}" for name, n in counts.items()))


FULL_ATTENTION = KVCacheGroups((KVCacheGroupSpec(()),))
