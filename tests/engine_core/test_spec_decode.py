"""N-gram speculative decoding in the engine core: the proposer, the config, and the
scheduler's drafts and roll-back against the fake worker (whose KV checks catch a
rejected draft's KV read as if it were real)."""

from __future__ import annotations

import pytest

from jaxserve.config import SpeculativeConfig
from jaxserve.engine.arg_utils import make_engine_config
from jaxserve.engine_core.core import EngineCore
from jaxserve.engine_core.request import Request
from jaxserve.engine_core.spec_decode import MAX_DRAFT_TOKENS_PER_STEP, DraftPolicy, NgramProposer
from jaxserve.sampling_params import SamplingParams

from .fake_worker import FakeWorker
from .helpers import BS, EOS, make_scheduler


def proposer(k: int = 3, lo: int = 1, hi: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(k, prompt_lookup_min=lo, prompt_lookup_max=hi))


def test_proposer_takes_the_longest_then_most_recent_match() -> None:
    p = proposer(k=3, lo=1, hi=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 8, 2, 3, 7, 6, 2, 3]
    # "2 3" occurs at 1..2 and 5..6 (longest suffix match: 2 tokens; "9 2 3" / "8 2 3"
    # / "6 2 3" differ); the most recent wins: 7 6 2.
    assert p.propose(tokens, 10) == [7, 6, 2]
    tokens = [5, 1, 2, 3, 4, 4, 4, 0, 1, 2, 3]  # "1 2 3" at 1..3: 3 tokens beat "3" alone
    assert p.propose(tokens, 10) == [4, 4, 4]
    assert p.propose(tokens, 2) == [4, 4]  # capped by the caller (budget, max_tokens)
    assert p.propose([1, 2, 3, 4], 10) == []  # 4 never occurred before
    assert proposer(lo=2).propose([1, 2, 3, 9, 3], 10) == []  # only a 1-token match
    assert p.propose([7, 7], 10) == [7]  # the match may run into the suffix itself
    assert p.propose([7], 10) == []


def test_speculative_config_validation() -> None:
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 5)
    assert SpeculativeConfig(2, prompt_lookup_min=7).prompt_lookup_max == 7
    assert SpeculativeConfig(2, prompt_lookup_max=1).prompt_lookup_min == 1
    for bad, field in [({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({}, "num_speculative_tokens"),
                       ({"num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 3}, "prompt_lookup_min"),
                       ({"num_speculative_tokens": 2, "draft": 1}, "unknown keys"),
                       ({"num_speculative_tokens": 2, "disable_by_batch_size": 0},
                        "disable_by_batch_size")]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.from_dict(bad)
    cfg = make_engine_config(speculative_config={"num_speculative_tokens": 2})
    assert cfg.speculative_config.num_speculative_tokens == 2
    assert not cfg.scheduler_config.async_scheduling  # speculation schedules synchronously


CYCLE = [10, 11, 12, 13, 14, 15, 16, 17]


def cyclic_token(req_id: str, position: int) -> int:
    """The 'model': continues the prompt's cycle, except at every 7th position (so some
    drafts are rejected) and EOS late for odd requests."""
    if position % 7 == 0:
        return 90 + position % 5
    if req_id.endswith(("1", "3")) and position > 50:
        return EOS
    return CYCLE[position % len(CYCLE)]


def run_engine(spec: SpeculativeConfig | None, num_blocks: int, caching: bool):
    sched = make_scheduler(num_blocks=num_blocks, max_model_len=72, max_num_batched_tokens=24,
                           enable_prefix_caching=caching, speculative_config=spec)
    if sched.drafter is not None:
        sched.drafter.policy.pays = lambda *_: True  # the fake worker's step times mean nothing
    worker = FakeWorker(num_blocks, BS, eos_token_id=EOS, token_fn=cyclic_token)
    core = EngineCore(sched, worker)
    for i in range(6):
        prompt = (CYCLE * 3)[i : i + 12 + 3 * i]
        core.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=20 + 5 * i)))
    tokens: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert sched.kv_cache_manager.get_num_free_blocks() == num_blocks - 1
    return tokens, sched, worker


@pytest.mark.parametrize("num_blocks", [64, 20])  # 20 pages: preemptions
@pytest.mark.parametrize("caching", [True, False])
def test_speculation_gives_the_same_tokens_in_fewer_steps(num_blocks, caching) -> None:
    plain, _, plain_worker = run_engine(None, num_blocks, caching)
    spec = SpeculativeConfig(3, prompt_lookup_min=2)
    tokens, sched, worker = run_engine(spec, num_blocks, caching)
    assert tokens == plain
    assert all(len(t) == 20 + 5 * int(r[1]) or t[-1] == EOS for r, t in tokens.items())
    assert worker.num_executed < 0.8 * plain_worker.num_executed
    drafts = [so.scheduled_spec_decode_tokens for so in worker.steps]
    assert any(drafts)
    stats = sched.make_stats().spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some rejected
    assert stats.num_accepted_tokens_per_pos[0] >= stats.num_accepted_tokens_per_pos[2]
    assert len(stats.num_accepted_tokens_per_pos) == 3
    if num_blocks == 20:
        assert sched.total_num_preemptions > 0


def test_drafts_respect_budget_max_tokens_and_batch_size() -> None:
    spec = SpeculativeConfig(4, prompt_lookup_min=1, disable_by_batch_size=1)
    sched = make_scheduler(speculative_config=spec, max_num_batched_tokens=64)
    sched.drafter.policy.pays = lambda *_: True
    worker = FakeWorker(64, BS, eos_token_id=EOS, token_fn=cyclic_token)
    core = EngineCore(sched, worker)
    core.add_request(Request("a", CYCLE * 2, SamplingParams(max_tokens=3)))
    while core.has_work():
        core.step()
    # max_tokens 3: the first decode step may emit at most 2 more, so 1 draft at most.
    assert max(len(d) for so in worker.steps for d in so.scheduled_spec_decode_tokens.values()) <= 1
    # Two requests running > disable_by_batch_size 1: no drafts at all.
    core.add_request(Request("b", CYCLE * 2, SamplingParams(max_tokens=8)))
    core.add_request(Request("c", CYCLE * 2 + [11], SamplingParams(max_tokens=8)))
    worker.steps.clear()
    core.step()  # both prefill
    core.step()
    assert not worker.steps[-1].scheduled_spec_decode_tokens
    # A request with penalties or logprobs never gets drafts.
    for params in (SamplingParams(max_tokens=8, frequency_penalty=0.5),
                   SamplingParams(max_tokens=8, logprobs=2)):
        sched2 = make_scheduler(speculative_config=SpeculativeConfig(4, prompt_lookup_min=1))
        sched2.drafter.policy.pays = lambda *_: True
        w2 = FakeWorker(64, BS, eos_token_id=EOS, token_fn=cyclic_token)
        core2 = EngineCore(sched2, w2)
        core2.add_request(Request("p", CYCLE * 2, params))
        while core2.has_work():
            core2.step()
        assert not any(so.scheduled_spec_decode_tokens for so in w2.steps)


def test_draft_policy_keeps_drafts_only_where_they_pay() -> None:
    policy = DraftPolicy()
    assert policy.pays(1, 7, 1)  # nothing measured: try the drafts' bucket first
    policy.observe_step(8, 0.040)
    assert not policy.pays(1, 7, 1)  # then the plain step's
    policy.observe_step(1, 0.024)
    policy.acceptance = 0.7
    # Bound by reading weights: 8 tokens cost 1.7x one and bring 1 + 0.7 * 7 = 5.9 tokens.
    assert policy.pays(1, 7, 1)
    # Bound by compute (a CPU at 16 requests): 8x the tokens cost ~8x the time.
    policy.observe_step(16, 0.067)
    policy.observe_step(128, 0.560)
    assert not policy.pays(16, 112, 16)
    policy.acceptance = 0.05  # drafts that are nearly always rejected never pay
    assert not policy.pays(1, 7, 1)
    policy.observe_drafts(10, 10)
    assert 0.05 < policy.acceptance < 0.2  # a moving mean, not the last step


def test_scheduler_drops_drafts_that_do_not_pay() -> None:
    spec = SpeculativeConfig(4, prompt_lookup_min=1)
    sched = make_scheduler(speculative_config=spec, max_num_batched_tokens=64)
    worker = FakeWorker(64, BS, eos_token_id=EOS, token_fn=cyclic_token)
    core = EngineCore(sched, worker)
    sched.drafter.policy.pays = lambda *_: False
    core.add_request(Request("a", CYCLE * 2, SamplingParams(max_tokens=12)))
    while core.has_work():
        core.step()
    assert not any(so.scheduled_spec_decode_tokens for so in worker.steps)
    assert all(n == 1 for so in worker.steps[1:] for n in so.num_scheduled_tokens.values())
    assert sched.drafter.policy.step_s  # the engine core fed it step times


def test_a_step_verifies_at_most_max_draft_tokens() -> None:
    spec = SpeculativeConfig(7, prompt_lookup_min=1)
    sched = make_scheduler(speculative_config=spec, max_num_seqs=32, max_num_batched_tokens=512,
                           max_model_len=64, num_blocks=600)
    sched.drafter.policy.pays = lambda *_: True
    worker = FakeWorker(600, BS, eos_token_id=EOS, token_fn=cyclic_token)
    core = EngineCore(sched, worker)
    for i in range(20):
        core.add_request(Request(f"r{i}", CYCLE * 2, SamplingParams(max_tokens=24)))
    while core.has_work():
        core.step()
    per_step = [sum(map(len, so.scheduled_spec_decode_tokens.values())) for so in worker.steps]
    assert max(per_step) == MAX_DRAFT_TOKENS_PER_STEP  # 20 requests x 7 would be 140


def test_async_scheduling_with_speculation_is_refused() -> None:
    with pytest.raises(ValueError, match="async_scheduling"):
        make_scheduler(async_scheduling=True, speculative_config=SpeculativeConfig(2))
