"""The architectures jaxserve serves: README lists exactly the registry's, and any other is a
clear error naming them."""

from __future__ import annotations

import os
import re

import pytest

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.architectures import ARCHITECTURES, supported_architectures

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_readme_lists_the_registrys_architectures() -> None:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("## Models"):]
    listed = section[:section.index("Any other name")]
    assert sorted(re.findall(r"`(\w+ForCausalLM)`", listed)) == supported_architectures()
    classifiers = {n for n in ARCHITECTURES if n.endswith("ForSequenceClassification")}
    assert classifiers == {n.replace("ForCausalLM", "ForSequenceClassification").replace(
        "Gemma3ForSeq", "Gemma3TextForSeq") for n in supported_architectures()
        if not ARCHITECTURES[n].linear_attention}  # the hybrids have no classifier yet


def test_an_unsupported_architecture_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM is not supported; supported: "
                                         "Gemma2ForCausalLM, Gemma3ForCausalLM, GptOss"):
        ArchConfig.from_hf_config({"architectures": ["GPTNeoXForCausalLM"]})


def test_layer_types_that_contradict_the_config_name_the_field() -> None:
    """Issue 50's bad input: a Gemma config whose layer_types and sliding_window disagree, or
    whose layer_types do not list each layer as a known kind, is refused naming the field."""
    base = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"]}
    assert ArchConfig.from_hf_config(base).layer_types == ("sliding_attention", "full_attention")
    with pytest.raises(ValueError, match="layer_types has sliding_attention layers but sliding_window is None"):
        ArchConfig.from_hf_config({**base, "sliding_window": None})
    with pytest.raises(ValueError, match=r"layer_types must list 2 layers \(num_hidden_layers\)"):
        ArchConfig.from_hf_config({**base, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="each one of sliding_attention, full_attention; got"):
        ArchConfig.from_hf_config({**base, "layer_types": ["full_attention", "chunked_attention"]})
