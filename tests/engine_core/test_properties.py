"""Property tests: random streams of adds, steps (fake tokens, random EOS) and aborts.

After every step: no step over its token budget or max_num_seqs, reference
counts equal the number of block tables holding each page, the free queue holds
exactly the unreferenced pages, the worker's block tables equal the
scheduler's (where a sliding window gave a page back, the scheduler's is null),
a sliding-window group holds no more pages than its window and a step need, and a
recurrent group no more than two state slots. The fake worker checks that every
step reads the state after exactly the request's computed tokens (so a state hit
lands only on a boundary whose state was written) and never a slot another request
owns. After draining: every page and slot is free, every request finished exactly
once (or was aborted), and each token stream and finish reason equals an
independent oracle, whatever the scheduling mode, preemptions or cache hits.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from jaxserve.engine_core.core import EngineCore
from jaxserve.engine_core.request import Request
from jaxserve.engine_core.scheduler import Scheduler
from jaxserve.kv_cache_spec import KVCacheGroups, KVCacheGroupSpec
from jaxserve.outputs import FinishReason
from jaxserve.sampling_params import SamplingParams

from .fake_worker import FakeAsyncWorker, fake_token

EOS = 2
VOCAB = 64
EOS_PROB = 0.04
# KV cache groups' kinds: None full attention, an int a sliding window, "sK" a recurrent
# state kept every K pages ("s0": none kept). One full group (most models), all sliding
# (Mistral), hybrid (Gemma 2/3, GPT-OSS), linear attention beside full (Qwen3-Next,
# Qwen3.5) and all three kinds.
WINDOWS = ((None,), (None,), (5,), (None, 6, 6), (None, 3), (None, "s2"), (None, "s1", "s1"),
           (None, "s0"), (None, 4, "s2"))
PREFIXES = ([10 + (7 * i) % 50 for i in range(24)], [11 + (5 * i) % 50 for i in range(24)])


@dataclass
class Spec:
    req_id: str
    prompt: list[int]
    params: SamplingParams


def stop_reason_at(spec: Spec, out: list[int], max_model_len: int) -> FinishReason | None:
    """The oracle: vLLM's stop rules for the stream `out` (last token just added)."""
    p, n, tok = spec.params, len(out), out[-1]
    if n >= p.min_tokens and ((tok == EOS and not p.ignore_eos) or tok in p.stop_token_ids):
        return FinishReason.STOP
    if n >= p.max_tokens or len(spec.prompt) + n >= max_model_len:
        return FinishReason.LENGTH
    return None


def expected(spec: Spec, max_model_len: int) -> tuple[list[int], FinishReason]:
    """The stream a deterministic FakeWorker produces, and its finish reason."""
    out: list[int] = []
    while True:
        out.append(fake_token(spec.req_id, len(spec.prompt) + len(out), VOCAB, EOS, EOS_PROB))
        reason = stop_reason_at(spec, out, max_model_len)
        if reason is not None:
            return out, reason


configs = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([2, 4, 8]),
        "max_model_len": st.integers(8, 48),
        "extra_pages": st.integers(0, 10),
        "budget": st.integers(1, 48),
        "max_num_seqs": st.integers(1, 8),
        "chunked": st.booleans(),
        "windows": st.sampled_from(WINDOWS),
    }
)

add_op = st.tuples(
    st.just("add"),
    st.integers(1, 47),  # prompt length (clipped to max_model_len - 1)
    st.sampled_from([None, 0, 1]),  # shared prefix
    st.integers(1, 20),  # max_tokens
    st.integers(0, 3),  # min_tokens (clipped to max_tokens)
    st.integers(0, 3),  # priority
    st.booleans(),  # ignore_eos
    st.sampled_from([(), (11,), (12, 13)]),  # stop_token_ids
    st.sampled_from([None, "tenant"]),  # cache_salt
)
ops = st.lists(
    st.one_of(add_op, add_op, st.tuples(st.just("step"), st.integers(1, 6)),
              st.tuples(st.just("abort"), st.integers(0, 30))),
    min_size=4,
    max_size=50,
)


def random_ops(rng: random.Random, n: int) -> list[tuple]:
    """A long stream with memory pressure (for the seed-driven test)."""
    out: list[tuple] = []
    for _ in range(n):
        x = rng.random()
        if x < 0.4:
            out.append(("add", rng.randint(1, 47), rng.choice([None, 0, 1]), rng.randint(1, 24),
                        rng.randint(0, 3), rng.randint(0, 3), rng.random() < 0.3,
                        rng.choice([(), (11,), (12, 13)]), rng.choice([None, "tenant"])))
        elif x < 0.9:
            out.append(("step", rng.randint(1, 4)))
        else:
            out.append(("abort", rng.randint(0, 1000)))
    return out


def check_invariants(sched: Scheduler, worker: FakeAsyncWorker, cfg: SchedulerConfig) -> None:
    kv = sched.kv_cache_manager
    for so in worker.steps:
        assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
    worker.steps.clear()
    managers = kv.coordinator.managers
    holders = set().union(*(m.req_to_blocks for m in managers))
    tables = [kv.get_blocks(req_id) or () for req_id in holders]
    for pool in kv.coordinator.pools:  # pages, and the recurrent groups' state slots
        groups = [m.group for m in managers if m.block_pool is pool]
        refs = Counter(b.block_id for table in tables for g in groups for b in table[g]
                       if not b.is_null)
        free = pool.free_block_queue.get_all_free_blocks()
        assert len(free) == pool.get_num_free_blocks()
        assert {b.block_id for b in free} == {
            b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null
        }
        for b in pool.blocks[1:]:
            assert b.ref_cnt == refs[b.block_id], b
        for h, b in pool.cached_block_hash_to_block.items():
            assert b.block_hash == h
    attention = [share for m, share in zip(managers, kv.group_usage()) if m.block_pool is kv.block_pool]
    assert sum(attention) == pytest.approx(kv.usage)
    for m, share in zip(managers, kv.group_usage()):
        held = {b.block_id for table in tables for b in table[m.group] if not b.is_null}
        assert share * (m.block_pool.num_blocks - 1) == pytest.approx(len(held))
    assert holders == {r.req_id for r in sched.running}
    assert len(sched.running) <= cfg.max_num_seqs
    for r in sched.running:
        w = worker.reqs[r.req_id]
        for group, (mine, theirs) in enumerate(zip(kv.get_block_ids(r.req_id), w.block_ids)):
            spec = kv.kv_cache_groups.groups[group]
            window = spec.sliding_window
            assert len(mine) == len(theirs)
            assert all(a in (b, 0) for a, b in zip(mine, theirs))
            assert (window or spec.recurrent) or 0 not in mine
            held = sum(1 for a in mine if a)
            if window is not None:
                assert held <= -(-(window - 1 + cfg.max_num_batched_tokens) // kv.block_size) + 1
            if spec.recurrent:
                assert held <= spec.max_state_slots()
        # The worker computes from its own copy of the tokens: it must agree.
        assert w.tokens[: r.num_tokens] == r.all_token_ids, r.req_id
        assert r.num_tokens <= cfg.max_model_len and r.num_output_tokens <= r.max_tokens
    for r in sched.waiting:
        assert r.num_computed_tokens == 0 and r.req_id not in holders


def group_spec(group: int, kind: int | str | None, block_size: int) -> KVCacheGroupSpec:
    """A one-layer group of the kind WINDOWS names."""
    if isinstance(kind, str):
        return KVCacheGroupSpec((group,), recurrent=True, state_block_size=int(kind[1:]) * block_size)
    return KVCacheGroupSpec((group,), kind)


def run_stream(data_cfg, op_list, async_scheduling, caching, policy, deterministic=True,
               batch_queue_size=2) -> None:
    bs, mml = data_cfg["block_size"], data_cfg["max_model_len"]
    budget = data_cfg["budget"] if data_cfg["chunked"] else max(data_cfg["budget"], mml)
    cfg = SchedulerConfig(
        max_num_seqs=data_cfg["max_num_seqs"], max_num_batched_tokens=budget, max_model_len=mml,
        policy=policy, enable_chunked_prefill=data_cfg["chunked"],
        async_scheduling=async_scheduling,
    )
    kinds = data_cfg.get("windows", (None,))
    if not data_cfg["chunked"]:  # kept states need chunked prefill (steps end on boundaries)
        kinds = tuple("s0" if isinstance(k, str) else k for k in kinds)
    groups = KVCacheGroups(tuple(group_spec(g, k, bs) for g, k in enumerate(kinds)),
                           num_slots=1 if len(kinds) > 1 else None)
    num_blocks = groups.min_num_blocks(mml, bs, budget) + data_cfg["extra_pages"]
    # A state for each running request and each one starting a state block, and as many again
    # for states kept in the prefix cache (the fewer, the more of them are evicted).
    num_state_slots = (2 * cfg.max_num_seqs * groups.state_slots_per_request() + 1
                       if groups.has_recurrent else 0)
    sched = Scheduler(cfg, CacheConfig(block_size=bs, enable_prefix_caching=caching),
                      num_blocks, eos_token_id=EOS, kv_cache_groups=groups,
                      num_state_slots=num_state_slots)
    windows = tuple(g.sliding_window for g in groups.groups)
    state_blocks = tuple(sched.kv_cache_manager.coordinator.managers[i].block_size
                         if g.recurrent else None for i, g in enumerate(groups.groups))
    worker = FakeAsyncWorker(num_blocks, bs, vocab_size=VOCAB, eos_token_id=EOS,
                             eos_prob=EOS_PROB, deterministic=deterministic, windows=windows,
                             state_blocks=state_blocks)
    core = EngineCore(sched, worker, batch_queue_size=batch_queue_size)
    specs: list[Spec] = []
    tokens: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    aborted: set[str] = set()

    def one_step() -> None:
        outs = core.step_with_batch_queue() if async_scheduling else core.step()
        for o in outs or ():
            assert o.req_id not in finished and o.req_id not in aborted
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finished:
                finished[o.req_id] = o.finish_reason
        check_invariants(sched, worker, cfg)

    for op in op_list:
        if op[0] == "add":
            _, plen, prefix, max_tokens, min_tokens, prio, ignore_eos, stop_ids, salt = op
            plen = min(plen, mml - 1)
            req_id = f"r{len(specs)}"
            head = [] if prefix is None else PREFIXES[prefix][: plen - 1]
            prompt = head + [20 + (len(specs) * 13 + j) % 40 for j in range(plen - len(head))]
            params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                                    ignore_eos=ignore_eos, stop_token_ids=list(stop_ids))
            specs.append(Spec(req_id, prompt, params))
            core.add_request(Request(req_id, prompt, params, priority=prio, cache_salt=salt))
        elif op[0] == "step":
            for _ in range(op[1]):
                one_step()
        elif specs:
            req_id = specs[op[1] % len(specs)].req_id
            if req_id not in finished:
                aborted.add(req_id)
            core.abort_requests(req_id)

    for _ in range(5000):
        if not core.has_work():
            break
        one_step()
    assert not core.has_work(), "engine did not drain (livelock?)"

    kv = sched.kv_cache_manager
    assert kv.get_num_free_blocks() == num_blocks - 1
    for pool in kv.coordinator.pools:
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert all(m.req_to_blocks == {} for m in kv.coordinator.managers)
    assert sched.requests == {} and worker.reqs == {}
    assert set(finished) | aborted == {s.req_id for s in specs}
    assert not set(finished) & aborted
    for spec in specs:
        got = tokens.get(spec.req_id, [])
        assert len(got) <= spec.params.max_tokens
        # Only the last token may end the stream, with the right reason.
        for k in range(1, len(got)):
            assert stop_reason_at(spec, got[:k], mml) is None, (spec.req_id, k)
        if spec.req_id not in aborted:
            assert got and finished[spec.req_id] is stop_reason_at(spec, got, mml)
        if deterministic:
            want_tokens, want_reason = expected(spec, mml)
            assert got == want_tokens[: len(got)], spec.req_id


@pytest.mark.parametrize("policy", list(SchedulingPolicy))
@pytest.mark.parametrize("caching", [True, False], ids=["prefix_cache", "no_cache"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data_cfg=configs, op_list=ops)
def test_random_streams(async_scheduling, caching, policy, data_cfg, op_list):
    run_stream(data_cfg, op_list, async_scheduling, caching, policy)


@pytest.mark.parametrize("policy", list(SchedulingPolicy))
@pytest.mark.parametrize("caching", [True, False], ids=["prefix_cache", "no_cache"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), max_model_len=st.integers(16, 48),
       extra_pages=st.integers(0, 6), budget=st.integers(4, 32), max_num_seqs=st.integers(2, 8))
def test_long_random_streams_under_memory_pressure(
    async_scheduling, caching, policy, seed, max_model_len, extra_pages, budget, max_num_seqs
):
    rng = random.Random(seed)
    data_cfg = {"block_size": rng.choice([2, 4, 8]), "max_model_len": max_model_len,
                "extra_pages": extra_pages, "budget": budget, "max_num_seqs": max_num_seqs,
                "chunked": rng.random() < 0.8, "windows": rng.choice(WINDOWS)}
    # Three steps in flight make preemptions with tokens in flight common.
    run_stream(data_cfg, random_ops(rng, rng.randint(40, 120)), async_scheduling, caching, policy,
               deterministic=False, batch_queue_size=rng.choice([2, 3]))
