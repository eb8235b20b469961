"""A host-only stand-in for the worker, for the engine-core tests.

It consumes SchedulerOutput exactly as the real worker must (see
sched_output.py): it keeps its own copy of each request's tokens and block
tables (one per KV cache group), "computes" KV by writing token ids into a fake
paged cache per group, and reads back every page attention would (a sliding
window group: only the window's). So it checks the contract as well as
feeding the scheduler: a page handed to two requests, a stale prefix-cache
hit, a diff that disagrees with the worker's copy, or a scheduled position
without an input token all fail an assertion here.

By default sampled tokens are a pure function of (req_id, position), so a run
gives the same tokens with sync or async scheduling and with or without
preemption. Draft tokens (speculative decoding) are verified against that
function, as greedy verification would: the accepted prefix and one more token
come back, and the worker's num_computed_tokens rolls back over the rest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxserve.engine_core.model_runner_output import LogprobsLists, ModelRunnerOutput
from jaxserve.engine_core.sched_output import SchedulerOutput
from jaxserve.sampling_params import SamplingParams


@dataclass
class _ReqState:
    tokens: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    sampling_params: SamplingParams


def fake_token(req_id: str, position: int, vocab_size: int, eos_token_id: int | None,
               eos_prob: float, nonce: int = 0) -> int:
    """'Sampled' token for position `position` of `req_id`; a pure function
    of its arguments."""
    digest = hashlib.blake2b(f"{req_id}:{position}:{nonce}".encode(), digest_size=8).digest()
    x = int.from_bytes(digest, "little")
    if eos_token_id is not None and (x & 0xFFFF) / 0x10000 < eos_prob:
        return eos_token_id
    return (x >> 16) % vocab_size


class FakeWorker:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int = 1000,
        eos_token_id: int | None = None,
        eos_prob: float = 0.0,
        check_kv: bool = True,
        deterministic: bool = True,
        token_fn: Callable[[str, int], int] | None = None,
        windows: tuple[int | None, ...] = (None,),
        state_blocks: tuple[int | None, ...] | None = None,
    ) -> None:
        """deterministic=False mixes the step number into each token, like real
        sampling: then a token the scheduler and the worker disagree on shows up.
        `state_blocks`: per group, None for attention, or a recurrent group's tokens per
        table entry; its "state" in a slot is the tuple of tokens it has seen."""
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_prob = eos_prob
        self.check_kv = check_kv
        self.deterministic = deterministic
        self.token_fn = token_fn  # (req_id, position) -> token, instead of fake_token
        self.windows = windows  # each KV cache group's sliding window (None: full attention)
        self.state_blocks = state_blocks or (None,) * len(windows)
        self.kv = np.full((len(windows), num_blocks, block_size), -1, dtype=np.int64)
        self.states: dict[tuple[int, int], tuple[int, ...]] = {}  # (group, slot) -> tokens seen
        self.reqs: dict[str, _ReqState] = {}
        self.steps: list[SchedulerOutput] = []
        self.num_executed = 0

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(so)
        self.num_executed += 1
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.reqs, f"{nr.req_id} sent twice as new"
            self.reqs[nr.req_id] = _ReqState(
                list(nr.prompt_token_ids) + list(nr.output_token_ids),
                tuple(list(ids) for ids in nr.block_ids),
                nr.num_computed_tokens,
                nr.sampling_params,
            )
        cached = so.scheduled_cached_reqs
        for req_id, new_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            st = self.reqs[req_id]
            assert st.num_computed_tokens == num_computed, (req_id, st.num_computed_tokens)
            assert len(new_ids) == len(self.windows)
            for ids, new in zip(st.block_ids, new_ids):
                ids.extend(new)
        assert set(so.num_scheduled_tokens) == {n.req_id for n in so.scheduled_new_reqs} | set(
            cached.req_ids
        )
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())

        bs = self.block_size
        spec = so.scheduled_spec_decode_tokens
        # A recurrent layer reads every request's initial state before any writes its own.
        self._read_states(so)
        # Write the KV of every scheduled token first (as each layer does) ...
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.reqs[req_id]
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            drafts = spec.get(req_id, [])
            assert n > 0
            assert not drafts or end - len(drafts) == len(st.tokens), "drafts after a known token"
            assert end - len(drafts) <= len(st.tokens), f"{req_id}: position {end - 1} has no input token"
            for g, ids in enumerate(st.block_ids):
                entry = self.state_blocks[g]
                if entry is not None:  # the state after the step's last token
                    slot = ids[(end - 1) // entry]
                    assert slot != 0, f"{req_id}: writes its state to the null slot"
                    self.states[g, slot] = tuple((st.tokens + drafts)[:end])
                    continue
                assert -(-end // bs) <= len(ids), f"{req_id}: no page for position {end - 1}"
                seen = np.asarray(ids)[self._first_read(g, start) // bs : -(-end // bs)]
                assert 0 not in seen, f"{req_id}: the null page in group {g}'s window"
                if self.check_kv:
                    pos = np.arange(start, end)
                    self.kv[g, np.asarray(ids)[pos // bs], pos % bs] = \
                        (st.tokens + drafts)[start:end]
        # ... then read all context back, as attention does.
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.reqs[req_id]
            end = st.num_computed_tokens + n
            drafts = spec.get(req_id, [])
            for g, ids in enumerate(st.block_ids if self.check_kv else ()):
                if self.state_blocks[g] is not None:
                    continue
                pos = np.arange(self._first_read(g, st.num_computed_tokens), end)
                got = self.kv[g, np.asarray(ids)[pos // bs], pos % bs]
                bad = np.nonzero(got != np.asarray((st.tokens + drafts)[pos[0] : end]))[0]
                assert bad.size == 0, f"{req_id}: stale KV of group {g} at positions {pos[bad[:8]]}"
            st.num_computed_tokens = end
            req_ids.append(req_id)
            if end - len(drafts) == len(st.tokens):
                emitted = []
                for j in range(len(drafts) + 1):
                    emitted.append(self._token(req_id, len(st.tokens) + j))
                    if j == len(drafts) or drafts[j] != emitted[-1]:
                        break
                st.tokens.extend(emitted)
                st.num_computed_tokens = end - len(drafts) + len(emitted) - 1
                sampled.append(emitted)
            else:
                sampled.append([])
        logprobs = LogprobsLists(
            token_ids=[[s[0] if s else 0, 1, 2] for s in sampled],
            logprobs=[[-0.5, -0.1, -2.0] for _ in sampled],
            sampled_token_ranks=[2 for _ in sampled],
        )
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=logprobs,
        )


    def _read_states(self, so: SchedulerOutput) -> None:
        """Each recurrent group's initial state of each request: the entry of its last
        computed token, which must hold the state after exactly its computed tokens."""
        for req_id in so.num_scheduled_tokens:
            st = self.reqs[req_id]
            start = st.num_computed_tokens
            for g, ids in enumerate(st.block_ids):
                entry = self.state_blocks[g]
                if entry is None or start == 0:
                    continue
                slot = ids[(start - 1) // entry]
                assert slot != 0, f"{req_id}: reads its state from the null slot"
                assert self.states.get((g, slot)) == tuple(st.tokens[:start]), (
                    f"{req_id}: group {g}'s state in slot {slot} is not the one after its "
                    f"{start} computed tokens")

    def _first_read(self, group: int, start: int) -> int:
        """The first position a query at `start` or later reads in `group`."""
        w = self.windows[group]
        return 0 if w is None else max(start - w + 1, 0)

    def _token(self, req_id: str, position: int) -> int:
        if self.token_fn is not None:
            return self.token_fn(req_id, position)
        nonce = 0 if self.deterministic else self.num_executed
        return fake_token(req_id, position, self.vocab_size, self.eos_token_id, self.eos_prob, nonce)


class FakeHandle:
    def __init__(self, worker: FakeWorker, so: SchedulerOutput) -> None:
        self._out = worker.execute_model(so)
        self.result_called = False

    def result(self) -> ModelRunnerOutput:
        self.result_called = True
        return self._out


class FakeAsyncWorker(FakeWorker):
    """Executes at dispatch (device steps run in order) and records how many
    steps were in flight when each result was awaited."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handles: list[FakeHandle] = []
        self.max_in_flight = 0

    def execute_model_async(self, so: SchedulerOutput) -> FakeHandle:
        handle = FakeHandle(self, so)
        self.handles.append(handle)
        in_flight = sum(not h.result_called for h in self.handles)
        self.max_in_flight = max(self.max_in_flight, in_flight)
        return handle
