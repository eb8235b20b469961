"""The worker's pooling, step by step: which token rows each pooling type reads, partial
sums over chunks, MEAN's division, normalization, and requests removed mid-flight."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.pooling_params import PoolingParams
from jaxserve.worker.pooler import Pooler, pool_sums

H = 3


def chunk(pooler: Pooler, hidden: np.ndarray, req_ids: list[str], starts: list[int],
          counts: list[int], prompt_lens: list[int]) -> dict[str, list[float]]:
    """One step: request i computes positions starts[i]..+counts[i] (hidden rows in order)."""
    kv_lens = np.array([s + c for s, c in zip(starts, counts)])
    cu = np.concatenate([[0], np.cumsum(counts)])
    T = int(cu[-1]) + 2  # padding rows
    padded = np.concatenate([hidden, np.full((2, H), 99.0)]).astype(np.float32)
    found = pooler.segments(req_ids, kv_lens, cu, np.array(prompt_lens), T)
    if found is None:
        return {}
    seg, rows = found
    sums = np.asarray(pool_sums(padded, seg, pooler.max_segments))
    return pooler.finish(sums, rows)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_pooled_over_three_chunks_beside_a_generation_request(pooling: str) -> None:
    rng = np.random.default_rng(0)
    states = rng.normal(size=(7, H)).astype(np.float32)  # the prompt's 7 final states
    gen = rng.normal(size=(2, H)).astype(np.float32)
    pooler = Pooler(max_segments=4)
    pooler.add_request("e", PoolingParams(pooling, normalize=False))
    got = {}
    for lo, hi in ((0, 3), (3, 5), (5, 7)):
        got |= chunk(pooler, np.concatenate([gen[:1], states[lo:hi]]), ["g", "e"], [9, lo],
                     [1, hi - lo], [4, 7])
        assert ("e" in got) == (hi == 7)
    want = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[pooling]
    np.testing.assert_allclose(got["e"], want, rtol=1e-6)


def test_normalized_and_batched() -> None:
    pooler = Pooler(max_segments=4)
    pooler.add_request("a", PoolingParams("MEAN"))
    pooler.add_request("b", PoolingParams("LAST"))
    h = np.array([[3, 0, 0], [0, 4, 0], [1, 1, 1], [0, 0, 2]], np.float32)
    got = chunk(pooler, h, ["a", "b"], [0, 0], [2, 2], [2, 2])
    np.testing.assert_allclose(got["a"], [0.6, 0.8, 0], rtol=1e-6)
    np.testing.assert_allclose(got["b"], [0, 0, 1], rtol=1e-6)


def test_a_request_removed_while_its_step_was_in_flight_is_dropped() -> None:
    pooler = Pooler(max_segments=2)
    pooler.add_request("e", PoolingParams("MEAN", normalize=False))
    h = np.ones((2, H), np.float32)
    kv, cu = np.array([2]), np.array([0, 2])
    seg, rows = pooler.segments(["e"], kv, cu, np.array([4]), 2)
    pooler.remove_request("e")  # preempted: it restarts from scratch
    assert pooler.finish(np.asarray(pool_sums(h, seg, 2)), rows) == {}
    pooler.add_request("e", PoolingParams("MEAN", normalize=False))
    assert chunk(pooler, 2 * np.ones((4, H)), ["e"], [0], [4], [4]) == {"e": [2.0] * H}
    assert not pooler._sums and pooler.segments(["x"], kv, cu, np.array([4]), 2) is None
