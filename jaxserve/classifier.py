"""A sequence classifier's head (vLLM's classify and score tasks), decided once from config.json.

A decoder `*ForSequenceClassification` checkpoint is the decoder plus `score.weight`
[num_labels, hidden]; its logits are that head applied to the final-norm hidden state of the
prompt's last token (transformers pools the last token of an unpadded sequence). A causal LM
becomes one the way vLLM converts Qwen3-Reranker (`--hf-overrides` with
`classifier_from_token`): the head is the lm_head's rows of those tokens ("from_2_way_softmax":
yes minus no, one label; "no_post_processing": the rows as they are).

Which activation turns logits into what the API returns follows vLLM's pooler: for classify,
config.json's `problem_type` (regression: none; multi-label: sigmoid), else sigmoid for one
label and softmax for several; for score, a sentence-transformers cross-encoder's
`activation_fn`, else the same rule. JAX-free (the API server reads it from the ready message).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

CONVERT_METHODS = ("from_2_way_softmax", "no_post_processing")
ACTIVATIONS = ("softmax", "sigmoid", "identity")
# sentence-transformers' activation names -> ours (vLLM loads only torch.nn modules, by name).
_TORCH_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid",
                      "torch.nn.modules.activation.Softmax": "softmax",
                      "torch.nn.modules.linear.Identity": "identity"}


def is_classifier_architecture(name: str) -> bool:
    return name.endswith("ForSequenceClassification")


@dataclass(frozen=True)
class ClassifierConfig:
    """`labels`: id2label in label order; `use_sep_token`: a /score pair is tokenized as
    `tokenizer(a, text_pair=b)` (a cross-encoder's special tokens between) when true, as the text
    a + b when false (vLLM's rule for an LLM made a reranker); `from_token_ids`: the lm_head rows
    the head is built from (a converted causal LM), with `method` saying how."""

    labels: tuple[str, ...]
    classify_activation: str
    score_activation: str
    use_sep_token: bool = True
    from_token_ids: tuple[int, ...] = ()
    method: str | None = None

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def activate(self, logits: np.ndarray, task: str) -> np.ndarray:
        """The task's activation of one prompt's logits (float64 [num_labels])."""
        kind = self.score_activation if task == "score" else self.classify_activation
        if kind == "sigmoid":
            return 1.0 / (1.0 + np.exp(-logits))
        if kind == "softmax":
            e = np.exp(logits - logits.max())
            return e / e.sum()
        return logits

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], token_ids: Any = None) -> ClassifierConfig:
        """From a classifier's config.json (with --hf-overrides applied). `token_ids` maps
        `classifier_from_token`'s tokens to ids (the tokenizer's convert_tokens_to_ids).
        ValueError names the field that does not make sense."""
        tokens = cfg.get("classifier_from_token")
        method = cfg.get("method")
        if cfg.get("is_original_qwen3_reranker"):
            method = method or "from_2_way_softmax"
        if tokens is not None:
            method = method or ("from_2_way_softmax" if len(tokens) == 2 else "no_post_processing")
            if method not in CONVERT_METHODS:
                raise ValueError(f"config.json's method {method!r} is not supported: "
                                 f"{', '.join(CONVERT_METHODS)}")
            if (not isinstance(tokens, list) or not tokens
                    or not all(isinstance(t, str) for t in tokens)
                    or (method == "from_2_way_softmax" and len(tokens) != 2)):
                raise ValueError("classifier_from_token must be a list of token strings (two, "
                                 f"[false, true], for from_2_way_softmax), got {tokens!r}")
            if token_ids is None:
                raise ValueError("classifier_from_token needs the model's tokenizer")
            ids = tuple(_token_id(token_ids, t) for t in tokens)
            labels = ("LABEL_0",) if method == "from_2_way_softmax" else tuple(tokens)
            n = len(labels)
            return cls(labels, _classify_activation(cfg, n), _score_activation(cfg, n),
                       use_sep_token=bool(cfg.get("use_sep_token", False)),
                       from_token_ids=ids, method=method)
        if method is not None:
            raise ValueError(f"config.json's method {method!r} needs classifier_from_token")
        labels = _labels(cfg)
        return cls(labels, _classify_activation(cfg, len(labels)),
                   _score_activation(cfg, len(labels)),
                   use_sep_token=bool(cfg.get("use_sep_token", True)))


def _token_id(token_ids: Any, token: str) -> int:
    i = token_ids(token)
    if i is None or (isinstance(i, int) and i < 0):
        raise ValueError(f"classifier_from_token: {token!r} is not a token of the tokenizer")
    return int(i)


def _labels(cfg: dict[str, Any]) -> tuple[str, ...]:
    """id2label in id order, or LABEL_i for `num_labels` (transformers' default, 2)."""
    id2label = cfg.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            order = sorted(id2label, key=int)
        except ValueError:
            raise ValueError(f"config.json's id2label keys must be label ids, got "
                             f"{list(id2label)[:4]}") from None
        if [int(k) for k in order] != list(range(len(order))):
            raise ValueError("config.json's id2label must number its labels 0..n-1")
        labels = tuple(str(id2label[k]) for k in order)
    else:
        labels = tuple(f"LABEL_{i}" for i in range(int(cfg.get("num_labels", 2))))
    n = cfg.get("num_labels")
    if n is not None and n != len(labels):
        raise ValueError(f"config.json's num_labels ({n}) and id2label ({len(labels)} labels) "
                         "disagree")
    if not labels:
        raise ValueError("config.json's classifier has no labels (num_labels 0)")
    return labels


def _classify_activation(cfg: dict[str, Any], num_labels: int) -> str:
    problem = cfg.get("problem_type") or ""
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    return "sigmoid" if num_labels < 2 else "softmax"


def _score_activation(cfg: dict[str, Any], num_labels: int) -> str:
    st = cfg.get("sentence_transformers")
    name = (st.get("activation_fn") if isinstance(st, dict) else None) or \
        cfg.get("sbert_ce_default_activation_function")
    if name is None:
        return "sigmoid" if num_labels < 2 else "softmax"
    if name not in _TORCH_ACTIVATIONS:
        raise ValueError(f"config.json's cross-encoder activation {name!r} is not supported: "
                         f"{', '.join(_TORCH_ACTIVATIONS)}")
    kind = _TORCH_ACTIVATIONS[name]
    # vLLM treats Sigmoid and Softmax alike: sigmoid for one label, softmax for several.
    return kind if kind == "identity" else ("sigmoid" if num_labels < 2 else "softmax")
