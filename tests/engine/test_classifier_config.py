"""A classifier's head from config.json (jaxserve/classifier.py): vLLM's activation rules, the
Qwen3-Reranker conversion's facts, and a start-up ValueError naming the field for a config
that does not make sense."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.classifier import ClassifierConfig
from jaxserve.pooling_params import PoolingParams

TOKENS = {"no": 4, "yes": 5}.get


def test_labels_and_activations_follow_vllm() -> None:
    three = ClassifierConfig.from_hf_config({"id2label": {"1": "b", "0": "a", "2": "c"}})
    assert three.labels == ("a", "b", "c") and three.use_sep_token
    assert (three.classify_activation, three.score_activation) == ("softmax", "softmax")
    np.testing.assert_allclose(three.activate(np.array([0.0, 0.0, np.log(2)]), "classify"),
                               [0.25, 0.25, 0.5])
    one = ClassifierConfig.from_hf_config({"num_labels": 1})
    assert one.labels == ("LABEL_0",) and one.activate(np.array([0.0]), "score") == 0.5
    regression = ClassifierConfig.from_hf_config({"num_labels": 1, "problem_type": "regression"})
    assert regression.activate(np.array([3.0]), "classify") == 3.0
    multi = ClassifierConfig.from_hf_config({"id2label": {"0": "x", "1": "y"},
                                             "problem_type": "multi_label_classification"})
    np.testing.assert_allclose(multi.activate(np.array([0.0, 0.0]), "classify"), [0.5, 0.5])
    # A sentence-transformers cross-encoder's own activation (by torch's name, as vLLM).
    ce = ClassifierConfig.from_hf_config({"num_labels": 1, "sentence_transformers": {
        "activation_fn": "torch.nn.modules.linear.Identity"}})
    assert ce.activate(np.array([2.0]), "score") == 2.0 and ce.classify_activation == "sigmoid"


def test_qwen3_reranker_overrides() -> None:
    head = ClassifierConfig.from_hf_config({"classifier_from_token": ["no", "yes"],
                                            "is_original_qwen3_reranker": True}, TOKENS)
    assert head.from_token_ids == (4, 5) and head.method == "from_2_way_softmax"
    assert head.num_labels == 1 and not head.use_sep_token  # the texts joined, no separator
    several = ClassifierConfig.from_hf_config({"classifier_from_token": ["yes"],
                                               "method": "no_post_processing"}, TOKENS)
    assert several.labels == ("yes",) and several.from_token_ids == (5,)


@pytest.mark.parametrize("cfg,field", [
    ({"num_labels": 3, "id2label": {"0": "a", "1": "b"}}, "num_labels"),
    ({"id2label": {"0": "a", "2": "b"}}, "id2label"),
    ({"num_labels": 0}, "no labels"),
    ({"method": "from_2_way_softmax"}, "needs classifier_from_token"),
    ({"classifier_from_token": ["yes"], "method": "from_2_way_softmax"}, "classifier_from_token"),
    ({"classifier_from_token": ["no", "yes"], "method": "mean"}, "method"),
    ({"classifier_from_token": ["no", "maybe"]}, "'maybe' is not a token"),
    ({"num_labels": 1, "sbert_ce_default_activation_function": "os.system"}, "activation"),
])
def test_bad_configs_name_the_field(cfg: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ClassifierConfig.from_hf_config(cfg, TOKENS)


def test_pooling_params_tasks() -> None:
    assert PoolingParams(task="token_embed").uses_prefix_cache is False
    assert PoolingParams(task="classify").uses_prefix_cache
    with pytest.raises(ValueError, match="task"):
        PoolingParams(task="rerank")
    with pytest.raises(ValueError, match="last token"):
        PoolingParams("MEAN", task="score")


def test_resolve_reads_the_overrides_and_the_tokenizers_vocabulary(tmp_path) -> None:
    """--hf-overrides reach config.json's reading; a token the vocabulary lacks is refused
    (transformers would answer <unk>'s id for it)."""
    import json

    from jaxserve.config import ModelConfig
    from jaxserve.engine.resolve import resolve_classifier
    from jaxserve.models.loaders import read_arch
    from jaxserve.models.model_files import resolve_model
    from tests.api_server.test_classifiers import RERANKER, save_char_tokenizer
    from tests.models.tiny import save_tiny_hf

    path = save_tiny_hf("qwen3", str(tmp_path))
    save_char_tokenizer(path)
    files = resolve_model(path, json.dumps(RERANKER))
    head = resolve_classifier(files, read_arch(files), ModelConfig(model=path))
    assert head is not None and head.from_token_ids == (4, 5)
    assert resolve_classifier(resolve_model(path), read_arch(path), ModelConfig(model=path)) is None
    bad = resolve_model(path, json.dumps({**RERANKER, "classifier_from_token": ["no", "maybe"]}))
    with pytest.raises(ValueError, match="'maybe' is not a token"):
        resolve_classifier(bad, read_arch(bad), ModelConfig(model=path))
