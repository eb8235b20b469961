"""The architectures jaxserve serves: README lists exactly the registry's, and any other is a
clear error naming them."""

from __future__ import annotations

import os
import re

import pytest

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.architectures import supported_architectures

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_readme_lists_the_registrys_architectures() -> None:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("## Models"):]
    listed = section[:section.index("Any other name")]
    assert sorted(re.findall(r"`(\w+ForCausalLM)`", listed)) == supported_architectures()


def test_an_unsupported_architecture_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM is not supported; supported: "
                                         "Gemma2ForCausalLM, Gemma3ForCausalLM, Llama"):
        ArchConfig.from_hf_config({"architectures": ["GPTNeoXForCausalLM"]})
