"""The model as the front ends see it, loaded once: its files, tokenizer, EOS ids and sampling
defaults, and the request checks built on them (`Processor`). The server's API process
(jaxserve/api_server/server.py) and the offline `LLM` (jaxserve/llm.py) both start here.
JAX-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxserve.classifier import ClassifierConfig
from jaxserve.config import ModelConfig, PoolerConfig
from jaxserve.engine.processor import Processor
from jaxserve.models.model_files import (
    ModelFiles,
    generation_defaults,
    model_eos_token_ids,
    resolve_model,
)
from jaxserve.models.tokenizer import load_tokenizer
from jaxserve.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class FrontEnd:
    files: ModelFiles
    tokenizer: Any  # None: skip_tokenizer_init (token-id prompts only, no text out)
    # Every id the model's own files say ends generation (besides the tokenizer's EOS).
    model_eos_token_ids: frozenset[int]
    # Sampling defaults from generation_config.json (--generation-config).
    generation_defaults: dict[str, float | int]

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS id, which the scheduler stops on (None without a tokenizer)."""
        eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        return None if eos is None else int(eos)

    def processor(self, max_model_len: int, vocab_size: int, pooler_config: PoolerConfig,
                  max_logprobs: int = MAX_LOGPROBS,
                  classifier: ClassifierConfig | None = None) -> Processor:
        """The request checks against the engine's limits (once the engine reports them)."""
        tokenizer = self.tokenizer
        encode = None if tokenizer is None else (
            lambda text: tokenizer.encode(text, add_special_tokens=False))
        return Processor(max_model_len, vocab_size, self.model_eos_token_ids, max_logprobs,
                         encode=encode, pooler_config=pooler_config, classifier=classifier)


def load_front_end(model_config: ModelConfig, generation_config: str = "auto",
                   chat_template: str | None = None) -> FrontEnd:
    """Read the model's files, tokenizer (`model_config.tokenizer` if given) and defaults.
    `generation_config`: "auto" (the model's generation_config.json), "vllm" (none) or a
    folder holding one; `chat_template`: a template's text replacing the tokenizer's."""
    files = resolve_model(model_config.model, model_config.hf_overrides)
    tokenizer = (None if model_config.skip_tokenizer_init
                 else load_tokenizer(model_config.tokenizer or files))
    if chat_template is not None and tokenizer is not None:
        tokenizer.chat_template = chat_template
    defaults = ({} if generation_config == "vllm" else generation_defaults(
        files if generation_config == "auto" else generation_config))
    return FrontEnd(files, tokenizer, model_eos_token_ids(files), defaults)
