"""The resolution stage refuses flags the checkpoint contradicts, naming the flags, before any
weight is read (jaxserve/engine/resolve.py: refuse_contradictions)."""

from __future__ import annotations

import jax
import pytest

from jaxserve.engine.arg_utils import make_engine_config
from jaxserve.engine.resolve import resolve_engine_config
from jaxserve.models.model_files import resolve_model
from tests.models.tiny import save_tiny_hf


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    """8 experts of intermediate size 32, 2 layers."""
    return save_tiny_hf("qwen3_moe", str(tmp_path_factory.mktemp("moe")))


@pytest.mark.parametrize("flags,message", [
    (dict(pipeline_parallel_size=3), "--pipeline-parallel-size 3 exceeds the model's 2 layers"),
    (dict(tensor_parallel_size=3),
     r"--tensor-parallel-size 3: the model's moe_intermediate_size \(32\) must be a multiple"),
    (dict(tensor_parallel_size=3, enable_expert_parallel=True),
     r"--tensor-parallel-size 3 with --enable-expert-parallel: the model's num_experts \(8\)"),
    (dict(quantization="bf16"), "quantization 'bf16' does not cover mixture-of-experts"),
], ids=["pp-over-layers", "tp-splits-experts", "ep-splits-experts", "bf16-experts"])
def test_contradictions_are_refused_before_loading(tiny_moe: str, flags: dict, message: str,
                                                   monkeypatch) -> None:
    import jaxserve.models.loaders as loaders

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the refusal")

    monkeypatch.setattr(loaders, "load_checkpoint", no_weights)
    config = make_engine_config(model=tiny_moe, **flags)
    devices = [jax.devices()[0]] * 3  # only their number and platform are read here
    with pytest.raises(ValueError, match=message):
        resolve_engine_config(config, resolve_model(tiny_moe), devices)


def test_a_layout_the_checkpoint_allows_resolves(tiny_moe: str) -> None:
    config = make_engine_config(model=tiny_moe, tensor_parallel_size=2, enable_expert_parallel=True)
    resolved = resolve_engine_config(config, resolve_model(tiny_moe), [jax.devices()[0]] * 2)
    assert resolved.resolved is not None and resolved.resolved.max_model_len == 256
