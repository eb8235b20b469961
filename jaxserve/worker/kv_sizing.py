"""KV-cache sizing on a device: how many pages fit beside the weights and the activations.

"Out of memory at start" is this box (kv_cache_manager's pages, sized by the worker). Per
device (the busiest one: its stage's layers, its share of heads and weights)::

    usable   = gpu_memory_utilization x device memory
    cache    = usable - weights - runner state - activations
    pages    = cache // bytes per page                    (page 0 is the null page)

`activations` is not an estimate: it is the largest temp (plus non-aliased outputs) that the
device compiler reports for the engine's biggest programs (worker/programs.py). The worker on
a real device and `python -m jaxserve.preflight` for a device the user does not have both run
`plan_kv_cache`, so the two agree on the same figures.
"""

from __future__ import annotations

import dataclasses

from jaxserve.kv_cache_spec import KVCacheGroups

GiB = 1 << 30


class InsufficientMemoryError(ValueError):
    """The configuration cannot fit the device: the message names the box, figures, knobs."""


def fmt_bytes(n: int | float) -> str:
    """Bytes in GiB / MiB / KiB, whichever reads best."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


KNOBS = ("--tensor-parallel-size (weights and cache split over more devices), --quantization "
         "int8 (int8 weights), a smaller --max-model-len, --max-num-batched-tokens / "
         "--max-num-seqs (smaller activations) or a higher --gpu-memory-utilization")
# The Gated DeltaNet hybrids refuse the first two (engine/resolve.py): not advice for them.
HYBRID_KNOBS = ("a smaller --max-model-len, --max-num-batched-tokens / --max-num-seqs (smaller "
                "activations) or a higher --gpu-memory-utilization (tensor parallelism and "
                "quantized weights are not supported for the Gated DeltaNet hybrids yet)")


def knobs(groups: KVCacheGroups) -> str:
    """The flags that make room, for a model with these cache groups."""
    return HYBRID_KNOBS if groups.recurrent_group() is not None else KNOBS


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """One device's memory, as the engine will use it (bytes are per device)."""

    device: str  # e.g. "TPU v6 lite", "NVIDIA H100 80GB HBM3"
    memory_bytes: int  # the device's memory
    utilization: float  # --gpu-memory-utilization
    weight_bytes: int
    state_bytes: int  # the runner's sampler state (penalties, last tokens)
    activation_bytes: int  # the largest program's temp + outputs
    page_bytes: int  # one KV page (a group's layers of the stage, this device's heads)
    page_size: int
    max_model_len: int
    num_pages: int  # including the null page 0
    groups: KVCacheGroups
    seq_pages: int  # pages one max_model_len sequence holds while decoding (every group's)
    # A Gated DeltaNet hybrid's pool of linear-attention states, carved out before the pages.
    num_state_slots: int = 0
    state_pool_bytes: int = 0

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * self.utilization)

    @property
    def cache_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def max_concurrent_seqs(self) -> int:
        """Sequences of max_model_len tokens the cache holds at once, decoding (and, for a
        model with linear-attention layers, that its state slots hold)."""
        seqs = max(self.num_pages - 1, 0) // self.seq_pages
        per_seq = self.groups.state_slots_per_request()
        if self.num_state_slots and per_seq:
            seqs = min(seqs, (self.num_state_slots - 1) // per_seq)
        return seqs

    @property
    def seqs_keeping_every_page(self) -> int:
        """max_concurrent_seqs if every layer kept every page (no sliding-window groups), in
        the same cache bytes: what the groups gain."""
        g = self.groups
        layers = sum(len(spec.layers) for spec in g.groups) if g.hybrid else 0
        full_page = self.page_bytes // g.num_slots * layers if g.num_slots is not None else self.page_bytes
        per_seq = -(-self.max_model_len // self.page_size)
        return max(self.cache_bytes // full_page - 1, 0) // per_seq

    def group_pages(self) -> list[tuple[str, int]]:
        """(group, pages one decoding max_model_len sequence holds in it) per group."""
        out = []
        for spec in self.groups.groups:
            if spec.recurrent:  # its slots are the state pool's (`num_state_slots`), no pages
                kept = (f", a state kept every {spec.state_block_size} tokens"
                        if spec.state_block_size else "")
                out.append((f"recurrent state, {len(spec.layers)} layers{kept}", 0))
                continue
            kind = ("full attention" if spec.sliding_window is None
                    else f"sliding window {spec.sliding_window}")
            out.append((f"{kind}, {len(spec.layers) or 'all'} layers",
                         spec.max_pages(self.max_model_len, self.page_size)))
        return out

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes a token of context costs (a max_model_len sequence's share)."""
        return self.seq_pages * self.page_bytes // self.max_model_len

    def state_pool_text(self) -> str:
        """", and N state slots (B)" for a model with linear-attention layers, else ""."""
        if not self.num_state_slots:
            return ""
        return (f" and {self.num_state_slots} linear-attention state slots "
                f"({fmt_bytes(self.state_pool_bytes)})")

    def summary(self) -> str:
        return (f"{self.device}: {fmt_bytes(self.memory_bytes)} x {self.utilization:g} = "
                f"{fmt_bytes(self.usable_bytes)} usable; weights {fmt_bytes(self.weight_bytes)}, "
                f"activations {fmt_bytes(self.activation_bytes)}, sampler state "
                f"{fmt_bytes(self.state_bytes)}, KV cache {fmt_bytes(self.cache_bytes)} = "
                f"{self.num_pages} pages of {self.page_size} tokens "
                f"({fmt_bytes(self.bytes_per_token)} per token of context; "
                f"{self.groups.describe()}){self.state_pool_text()}: "
                f"{self.max_concurrent_seqs} sequences of {self.max_model_len} tokens at once")


def check_weights_fit(device: str, memory_bytes: int, utilization: float, weight_bytes: int,
                      state_bytes: int, bytes_per_token: int, groups: KVCacheGroups) -> None:
    """Refuse, before anything compiles, a model whose weights alone do not fit."""
    usable = int(memory_bytes * utilization)
    if weight_bytes + state_bytes >= usable:
        raise InsufficientMemoryError(
            f"kv_cache_manager: no room for a KV cache on {device}: the weights take "
            f"{fmt_bytes(weight_bytes)} per device (+ {fmt_bytes(state_bytes)} sampler state) "
            f"of {fmt_bytes(usable)} usable ({utilization:g} x {fmt_bytes(memory_bytes)}), "
            f"before activations and a cache of {fmt_bytes(bytes_per_token)} per token. "
            f"Try {knobs(groups)}.")


def refuse_too_few_pages(num_pages: int, page_size: int, max_model_len: int, given_by: str,
                         knob: str, groups: KVCacheGroups, chunk: int) -> None:
    """A cache whose size the user set (`given_by`, turned with `knob`) must hold one
    max_model_len sequence (computing `chunk` tokens a step) and the null page."""
    need = groups.min_num_blocks(max_model_len, page_size, chunk)
    if num_pages < need:
        fits = groups.longest_fitting(num_pages, page_size, chunk)
        raise InsufficientMemoryError(
            f"kv_cache_manager: {given_by} gives the KV cache {num_pages} pages of {page_size} "
            f"tokens, but one request of max_model_len={max_model_len} needs {need}; the "
            f"largest max_model_len that fits is {fits}. Raise {knob} or lower --max-model-len.")


def plan_kv_cache(
    *, device: str, memory_bytes: int, utilization: float, weight_bytes: int, state_bytes: int,
    activation_bytes: int, page_bytes: int, page_size: int, max_model_len: int,
    groups: KVCacheGroups, chunk: int,
    kv_cache_memory_bytes: int | None = None, given_by: str | None = None,
    num_state_slots: int = 0, state_pool_bytes: int = 0,
) -> MemoryPlan:
    """The pages that fit (or `kv_cache_memory_bytes` of them, as the user asked with the
    flag `given_by`), or InsufficientMemoryError when not one max_model_len sequence
    (computing up to `chunk` tokens a step) fits."""
    check_weights_fit(device, memory_bytes, utilization, weight_bytes, state_bytes,
                      page_bytes // page_size, groups)
    room = int(memory_bytes * utilization) - weight_bytes - state_bytes - activation_bytes
    if kv_cache_memory_bytes is not None:
        room = kv_cache_memory_bytes
    room -= state_pool_bytes  # the linear-attention states first, then the pages
    plan = MemoryPlan(device, memory_bytes, utilization, weight_bytes, state_bytes,
                      activation_bytes, page_bytes, page_size, max_model_len,
                      max(room, 0) // page_bytes, groups,
                      groups.pages_per_request(max_model_len, page_size),
                      num_state_slots, state_pool_bytes)
    need = groups.min_num_blocks(max_model_len, page_size, chunk)
    if plan.num_pages < need:
        fits = groups.longest_fitting(plan.num_pages, page_size, chunk)
        if given_by is not None:
            refuse_too_few_pages(plan.num_pages, page_size, max_model_len, given_by,
                                 given_by.split()[0], groups, chunk)
        raise InsufficientMemoryError(
            f"kv_cache_manager: the KV cache has room for {plan.num_pages} pages of {page_size} "
            f"tokens on {device}, but one request of max_model_len={max_model_len} needs "
            f"{need}: weights {fmt_bytes(weight_bytes)} + activations "
            f"{fmt_bytes(activation_bytes)} + sampler state {fmt_bytes(state_bytes)} leave "
            f"{fmt_bytes(max(room, 0))} of {fmt_bytes(plan.usable_bytes)} usable, and the cache "
            f"takes {fmt_bytes(plan.bytes_per_token)} per token "
            f"({fmt_bytes(need * page_bytes)} for one sequence); the largest max_model_len that "
            f"fits is {fits}. Try {knobs(groups)}.")
    return plan
