"""vLLM's request fields jaxserve does not implement: each is accepted with the value that asks
for nothing, and any other value is a 400 naming the field, never silently ignored. README's
"Sampling parameters" lists them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
    name = info.field_name
    assert name is not None  # a field validator always runs for a field
    default = UNSUPPORTED_FIELDS[name]
    if value != default:
        raise ValueError(f"{name} is not supported by jaxserve (only {default!r} is accepted)")
    return value


# Declared fields (not extras) so that a refusal names its field as the error's param. Built
# from the table above, so the names and defaults are written once; the type checker sees a
# plain base model (it cannot follow a model built at run time).
if TYPE_CHECKING:
    class UnsupportedVllmFields(BaseModel):
        pass
else:
    UnsupportedVllmFields = create_model(
        "UnsupportedVllmFields",
        __validators__={"refuse_unsupported": field_validator(*UNSUPPORTED_FIELDS)(
            classmethod(_refuse_unsupported))},
        **{name: (Any, default) for name, default in UNSUPPORTED_FIELDS.items()},
    )
