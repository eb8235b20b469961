"""Packing: a step's named inputs travel as one int32 buffer and come back bit-exact."""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.worker.input_batch import StepInputs
from jaxserve.worker.packing import Packing


def test_round_trip_of_every_kind() -> None:
    packing = Packing((("ids", (3,), "i32"), ("table", (2, 2), "i32"), ("temp", (2,), "f32"),
                       ("seed", (2,), "u32"), ("real", (2,), "bool")))
    values = {"ids": [1, -2, 3], "table": [[4, 5], [6, 7]], "temp": [0.7, float("nan")],
              "seed": [2**32 - 1, 5], "real": [True, False]}
    buf = packing.pack(values)
    assert buf.dtype == np.int32 and buf.shape == (packing.size,) == (13,)
    out = jax.jit(packing.unpack)(buf)
    np.testing.assert_array_equal(out["ids"], [1, -2, 3])
    np.testing.assert_array_equal(out["table"], [[4, 5], [6, 7]])
    assert out["temp"].dtype == np.float32 and out["temp"][0] == np.float32(0.7)
    assert np.isnan(out["temp"][1])
    assert out["seed"].dtype == np.uint32 and int(out["seed"][0]) == 2**32 - 1
    np.testing.assert_array_equal(out["real"], [True, False])


def test_step_layout_holds_request_rows_for_the_tokens_only() -> None:
    """A T-token step carries min(T, max_num_seqs) page-table rows, not max_num_seqs."""
    small = dict((name, shape) for name, shape, _ in StepInputs.packing(1, 256, 512, 256).fields)
    assert small["page_indices"] == (1, 1, 512) and small["kv_lens"] == (1,)  # one KV group
    big = dict((name, shape) for name, shape, _ in StepInputs.packing(2048, 256, 512, 256).fields)
    assert big["page_indices"] == (1, 256, 512) and big["input_ids"] == (2048,)
    hybrid = dict((name, shape) for name, shape, _ in StepInputs.packing(8, 4, 16, 4, 3).fields)
    assert hybrid["page_indices"] == (3, 4, 16) and hybrid["slot_mapping"] == (3, 8)
    # With drafts to verify (speculative decoding), more logits rows than requests.
    spec = dict((name, shape) for name, shape, _ in StepInputs.packing(2048, 256, 512, 1280).fields)
    assert spec["logits_indices"] == (1280,) and spec["kv_lens"] == (256,)
