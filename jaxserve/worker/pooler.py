"""Pooling for embedding requests (vLLM's `Pooler`), chunk by chunk.

An embedding request's prompt runs through the same forward as generation, so chunked
prefill splits it over steps. Each step the runner asks the forward for every token's
final-norm hidden state (the variant prompt logprobs use) and `pool_sums` adds, per pooling
request, the rows its pooling type reads (LAST: the last prompt position; CLS: position 0;
MEAN: all of them) into one float32 row. `Pooler` keeps the partial sums on the host between
chunks and, in the step that finishes a prompt, turns them into the vector (MEAN divides by
the prompt length; `normalize` divides by the L2 norm). A classifier's classify and score
tasks apply its head to the last token's row on the host (a [num_labels, H] matrix, tiny)
and then its activation (jaxserve/classifier.py); token_embed keeps every prompt row, read
from the step's hidden states on the host.

    step k   tokens  [ r0 r0 r0 | r1 r1 | g g ]   segments [0 0 0 1 1 S S]   (S: dropped)
             pool_sums -> [S, H] rows 0, 1    Pooler: r0 += row 0, r1 += row 1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.classifier import ClassifierConfig
from jaxserve.pooling_params import PoolingParams
from jaxserve.worker.step_handle import host_array

_NORM_EPS = 1e-12  # torch.nn.functional.normalize's, as vLLM's pooler uses


def pool_sums(hidden: jax.Array, segments: jax.Array, num_segments: int) -> jax.Array:
    """[num_segments, H] float32: the sum of `hidden`'s rows in each segment (rows whose
    segment is out of range are dropped)."""
    return jax.ops.segment_sum(hidden.astype(jnp.float32), segments, num_segments=num_segments)


@dataclass(frozen=True)
class PoolingRows:
    """One pooling request in a step: its row of `pool_sums`' output, how many prompt
    positions it added, and whether the step finishes its prompt; for token_embed, where its
    positions start among the step's token rows."""

    req_id: str
    segment: int
    count: int
    final: bool
    num_prompt_tokens: int
    params: PoolingParams
    first_row: int = -1


class PoolSegments(NamedTuple):
    """A step's pooling work on the host: each token row's segment (`pool_sums`' input; out
    of range: dropped) and the step's pooling requests."""

    segments: np.ndarray  # i32[T]
    rows: list[PoolingRows]


class Pooler:
    """The worker's embedding requests (their PoolingParams) and their partial sums; a
    classifier's head (float32 [num_labels, H]) and config for classify and score."""

    def __init__(self, max_segments: int, score_head: np.ndarray | None = None,
                 classifier: ClassifierConfig | None = None) -> None:
        self.max_segments = max_segments
        self.score_head = score_head
        self.classifier = classifier
        self.requests: dict[str, PoolingParams] = {}
        self._sums: dict[str, np.ndarray] = {}
        self._rows: dict[str, list[np.ndarray]] = {}  # token_embed's rows so far

    def add_request(self, req_id: str, params: PoolingParams) -> None:
        """A new or resumed (recomputed from scratch) embedding request."""
        self.requests[req_id] = params
        self._sums.pop(req_id, None)
        self._rows.pop(req_id, None)

    def remove_request(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self._sums.pop(req_id, None)
        self._rows.pop(req_id, None)

    @staticmethod
    def wants_rows(rows: list[PoolingRows]) -> bool:
        """Whether `finish` needs the step's every-token hidden states (token_embed)."""
        return any(r.first_row >= 0 for r in rows)

    def segments(self, req_ids: list[str], kv_lens: np.ndarray, cu_q_lens: np.ndarray,
                 num_prompt_tokens: np.ndarray, T: int) -> PoolSegments | None:
        """Each token row's segment (`pool_sums`' input) and the step's pooling requests, or
        None when the step has none. Request i's chunk covers positions
        [kv_lens[i] - its tokens, kv_lens[i]); only prompt positions are pooled."""
        if not self.requests:
            return None
        seg = np.full(T, self.max_segments, np.int32)
        rows: list[PoolingRows] = []
        for i, req_id in enumerate(req_ids):
            params = self.requests.get(req_id)
            if params is None:
                continue
            start_tok, end = int(cu_q_lens[i]), int(kv_lens[i])
            first = end - (int(cu_q_lens[i + 1]) - start_tok)
            P = int(num_prompt_tokens[i])
            lo, hi = first, min(end, P)  # this chunk's prompt positions
            if params.task == "token_embed":
                pass  # every prompt position
            elif params.pooling_type == "LAST":
                lo = max(lo, P - 1)
            elif params.pooling_type == "CLS":
                hi = min(hi, 1)
            k = len(rows)
            if hi > lo:
                seg[start_tok + lo - first:start_tok + hi - first] = k
            if hi > lo or end >= P:
                at = start_tok + lo - first if params.task == "token_embed" else -1
                rows.append(PoolingRows(req_id, k, max(hi - lo, 0), end >= P, P, params, at))
        return PoolSegments(seg, rows) if rows else None

    def finish(self, sums: np.ndarray, rows: list[PoolingRows], hidden: jax.Array | None = None
               ) -> dict[str, list[float] | list[list[float]]]:
        """Add a step's `pool_sums` (on the host) to the partial sums; returns the vectors of
        the requests whose prompt it finished. `hidden`: the step's every-token states (on
        the device) when `wants_rows`. A request removed while the step was in flight
        (aborted, or preempted: it restarts from scratch) is skipped."""
        done: dict[str, list[float] | list[list[float]]] = {}
        every = None if hidden is None else host_array(hidden)
        for r in rows:
            if r.req_id not in self.requests:
                continue
            if r.params.task == "token_embed":
                assert every is not None
                got = self._rows.setdefault(r.req_id, [])
                got.append(every[r.first_row:r.first_row + r.count].astype(np.float32))
                if r.final:
                    done[r.req_id] = self._token_vectors(self._rows.pop(r.req_id), r.params)
                continue
            acc = sums[r.segment] + self._sums.get(r.req_id, 0.0)
            if not r.final:
                self._sums[r.req_id] = acc
                continue
            self._sums.pop(r.req_id, None)
            if r.params.task in ("classify", "score"):
                done[r.req_id] = self._classify(acc, r.params)
                continue
            if r.params.pooling_type == "MEAN":
                acc = acc / r.num_prompt_tokens
            if r.params.normalize:
                acc = acc / max(float(np.linalg.norm(acc)), _NORM_EPS)
            done[r.req_id] = acc.astype(np.float32).tolist()
        return done

    def _classify(self, last: np.ndarray, params: PoolingParams) -> list[float]:
        """The head's logits for the last token's state, activated unless asked not to."""
        assert self.score_head is not None and self.classifier is not None
        logits = self.score_head.astype(np.float64) @ last.astype(np.float64)
        if params.normalize:
            logits = self.classifier.activate(logits, params.task)
        return logits.astype(np.float32).tolist()

    @staticmethod
    def _token_vectors(parts: list[np.ndarray], params: PoolingParams) -> list[list[float]]:
        rows = np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)
        if params.normalize and rows.size:
            rows = rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), _NORM_EPS)
        return rows.tolist()

