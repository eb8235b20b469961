"""KV-cache sizing from the compiled programs (jaxserve/worker/kv_sizing.py): the figures, the
refusals, and one computation shared by the serving worker and the preflight."""

from __future__ import annotations

import pytest

from jaxserve.kv_cache_spec import FULL_ATTENTION, KVCacheGroups
from jaxserve.worker.kv_sizing import GiB, InsufficientMemoryError, plan_kv_cache

FIGURES = dict(device="TPU v6 lite", memory_bytes=32 * GiB, utilization=0.9,
               weight_bytes=16 * GiB, state_bytes=GiB // 8, activation_bytes=2 * GiB,
               page_bytes=16 * 128 * 1024, page_size=16, max_model_len=8192,
               groups=FULL_ATTENTION, chunk=512)


def test_pages_are_what_is_left_after_weights_state_and_activations() -> None:
    plan = plan_kv_cache(**FIGURES)
    left = int(32 * GiB * 0.9) - 16 * GiB - GiB // 8 - 2 * GiB
    assert plan.num_pages == left // (16 * 128 * 1024)
    assert plan.max_concurrent_seqs == (plan.num_pages - 1) // 512
    assert "TPU v6 lite: 32.00 GiB x 0.9 = 28.80 GiB usable" in plan.summary()
    assert plan_kv_cache(**{**FIGURES, "kv_cache_memory_bytes": 2 * GiB}).num_pages == 1024


def test_sliding_groups_fit_more_long_sequences_in_the_same_memory() -> None:
    # Gemma-3-4B's layers at 32k: 34 layers in one group, or 5 slots in 7 groups.
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(34)]
    layer_page = 16 * 4 * 1024  # 16 tokens of one layer
    same = dict(FIGURES, max_model_len=32768, weight_bytes=8 * GiB)
    full = plan_kv_cache(**{**same, "page_bytes": 34 * layer_page,
                            "groups": KVCacheGroups.for_layers(windows, hybrid=False)})
    hybrid = plan_kv_cache(**{**same, "page_bytes": 5 * layer_page,
                              "groups": KVCacheGroups.for_layers(windows)})
    assert hybrid.cache_bytes <= full.cache_bytes + hybrid.page_bytes
    assert hybrid.max_concurrent_seqs >= 5 * full.max_concurrent_seqs
    assert "7 groups of 5 layers: 1 full attention, 6 sliding window 1024" in hybrid.summary()


def test_weights_that_do_not_fit_are_refused_naming_the_box_and_knobs() -> None:
    with pytest.raises(InsufficientMemoryError) as e:
        plan_kv_cache(**{**FIGURES, "weight_bytes": 30 * GiB})
    msg = str(e.value)
    assert msg.startswith("kv_cache_manager: no room for a KV cache on TPU v6 lite")
    for knob in ("--tensor-parallel-size", "--quantization int8", "--max-model-len",
                 "--gpu-memory-utilization"):
        assert knob in msg
    # A Gated DeltaNet hybrid is not told to try the flags it refuses.
    hybrid = KVCacheGroups.for_linear_hybrid((3,), (0, 1, 2), 0)
    with pytest.raises(InsufficientMemoryError) as e:
        plan_kv_cache(**{**FIGURES, "weight_bytes": 30 * GiB, "groups": hybrid})
    msg = str(e.value)
    assert "--tensor-parallel-size" not in msg and "--quantization" not in msg
    assert "not supported for the Gated DeltaNet hybrids yet" in msg and "--max-model-len" in msg


def test_a_cache_smaller_than_one_sequence_is_refused_with_the_largest_that_fits() -> None:
    with pytest.raises(InsufficientMemoryError, match="the largest max_model_len that fits is") as e:
        plan_kv_cache(**{**FIGURES, "max_model_len": 131072, "activation_bytes": 9 * GiB})
    assert "128.00 KiB per token" in str(e.value) and "activations 9.00 GiB" in str(e.value)


def test_pages_the_user_gave_are_refused_naming_their_flag() -> None:
    with pytest.raises(InsufficientMemoryError) as e:
        plan_kv_cache(**{**FIGURES, "kv_cache_memory_bytes": 512 * 16 * 128 * 1024,
                         "given_by": "--num-gpu-blocks-override 512"})
    assert str(e.value) == (
        "kv_cache_manager: --num-gpu-blocks-override 512 gives the KV cache 512 pages of 16 "
        "tokens, but one request of max_model_len=8192 needs 513; the largest max_model_len "
        "that fits is 8176. Raise --num-gpu-blocks-override or lower --max-model-len.")


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    from jaxserve.engine.arg_utils import make_engine_config
    from tests.models.tiny import save_tiny_hf

    path = save_tiny_hf("llama", str(tmp_path_factory.mktemp("tiny")))
    from jaxserve.engine.resolve import resolve_engine_config

    return resolve_engine_config(
        make_engine_config(path, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128))


def test_serving_worker_and_preflight_size_the_cache_alike(tiny_config, monkeypatch) -> None:
    """For the same memory figures, the engine's own sizing on a device (real weights,
    determine_num_blocks) and the preflight's (abstract weights, no checkpoint read) compile
    the same programs and arrive at the same number of pages."""
    from jaxserve.worker.worker import Worker

    memory = 64 << 20
    serving = Worker(tiny_config)
    serving.load_model()
    monkeypatch.setattr(serving, "platform", "tpu")  # take the device path, on the CPU
    monkeypatch.setattr(serving, "device_memory", lambda: (memory, "test device"))
    num_blocks = serving.determine_num_blocks()
    preflight = Worker(tiny_config)
    preflight.load_abstract_model()
    monkeypatch.setattr(preflight, "platform", "tpu")  # the device's programs, as above
    plan = preflight.plan_memory(memory, "test device")
    assert num_blocks == plan.num_pages == serving.memory_plan.num_pages
    assert serving.memory_plan == plan
    assert plan.activation_bytes > 0 and plan.weight_bytes == serving.memory_plan.weight_bytes
    assert {c.name for c in preflight.sizing_programs} == {
        "forward[T=32]", "sample[R=4, filtered, processors]", "prompt_logprobs[T=32]"}


def test_dummy_weights_serve_from_a_config_json_alone(tmp_path) -> None:
    """--load-format dummy: random weights of the config's shapes, no checkpoint; the
    engine serves (token ids past the tokenizer's vocabulary decode to nothing, no error)."""
    import transformers

    from jaxserve import LLM, SamplingParams
    from jaxserve.models.tokenizer import load_tokenizer

    transformers.LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=60000, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256).save_pretrained(tmp_path)
    load_tokenizer(None).save_pretrained(tmp_path)  # the default model's (49,152 tokens)
    llm = LLM(str(tmp_path), load_format="dummy", max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=128, enforce_eager=True)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(max_tokens=5, temperature=1.0, seed=1), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    llm.shutdown()


def test_a_cpu_budget_too_small_for_one_sequence_is_refused_naming_its_flag(tiny_config) -> None:
    """The serving worker's own sizing (a byte budget on the CPU) refuses in the same words."""
    import dataclasses

    from jaxserve.worker.worker import Worker

    cc = dataclasses.replace(tiny_config.cache_config, kv_cache_memory_bytes=1024)
    worker = Worker(dataclasses.replace(tiny_config, cache_config=cc))
    worker.load_model()
    with pytest.raises(InsufficientMemoryError, match=r"kv_cache_manager: --kv-cache-memory-bytes "
                       r"1024 gives the KV cache 0 pages .* Raise --kv-cache-memory-bytes"):
        worker.determine_num_blocks()
