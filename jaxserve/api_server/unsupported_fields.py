"""vLLM's request fields jaxserve does not implement: each is accepted with the value that asks
for nothing, and any other value is a 400 naming the field, never silently ignored. README's
"Sampling parameters" lists them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationInfo, create_model, field_validator

# field -> the value that asks for nothing (vLLM's default)
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "spaces_between_special_tokens": True,
    "logits_processors": None,
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
    "structural_tag": None,
    "prompt_embeds": None,
    "mm_processor_kwargs": None,
    "documents": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "thinking_token_budget": None,
}


def _refuse_unsupported(cls: type, value: Any, info: ValidationInfo) -> Any:
    default = UNSUPPORTED_FIELDS[info.field_name]
    if value != default:
        raise ValueError(f"{info.field_name} is not supported by jaxserve (only {default!r} "
                         "is accepted)")
    return value


# Declared fields (not extras) so that a refusal names its field as the error's param. Built
# from the table above, so the names and defaults are written once.
UnsupportedVllmFields: type[BaseModel] = create_model(
    "UnsupportedVllmFields",
    __validators__={"refuse_unsupported": field_validator(*UNSUPPORTED_FIELDS)(
        classmethod(_refuse_unsupported))},
    **{name: (Any, default) for name, default in UNSUPPORTED_FIELDS.items()},
)
