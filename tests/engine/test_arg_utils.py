"""EngineArgs is the one source of the engine's arguments: every command line takes the same
flags with the same defaults, LLM(**kwargs) the same names, and the derived settings are
decided in create_engine_config."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from jaxserve.config import PoolerConfig
from jaxserve.engine.arg_utils import EngineArgs, make_engine_config
from jaxserve.pooling_params import PoolingParams


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from jaxserve.bench import throughput
    from jaxserve.generate import make_parser as generate_parser
    from jaxserve.preflight import make_parser as preflight_parser
    from jaxserve.serve import make_arg_parser

    bench = argparse.ArgumentParser()
    throughput.add_args(bench)
    return {"serve": make_arg_parser(), "preflight": preflight_parser(),
            "generate": generate_parser(), "bench throughput": bench}


# Where a command line's default differs from EngineArgs', on purpose (short benchmarks).
OVERRIDES = {"generate": {"max_model_len": 2048}, "bench throughput": {"max_model_len": 2048}}


@pytest.mark.parametrize("command", ["serve", "preflight", "generate", "bench throughput"])
def test_every_command_line_takes_every_engine_flag_with_its_default(command: str) -> None:
    parser = _parsers()[command]
    flags = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(EngineArgs):
        if not f.metadata["cli"]:
            assert f.name not in flags
            continue
        assert f.name in flags, f"{command} lacks --{f.name.replace('_', '-')}"
        want = OVERRIDES.get(command, {}).get(f.name, f.default)
        assert flags[f.name].default == want, (command, f.name)
    args = parser.parse_args(["--target", "v5e:1x1"] if command == "preflight" else [])
    defaults = dataclasses.replace(EngineArgs(), **OVERRIDES.get(command, {}))
    assert EngineArgs.from_cli_args(args) == defaults
    # The HTTP server's flags mean nothing to the other commands: they do not offer them.
    server_only = {"host", "port", "api_key", "uvicorn_log_level", "allowed_origins"}
    assert (server_only <= set(flags)) if command == "serve" else not server_only & set(flags)


def test_flags_parse_to_the_config_under_vllms_names() -> None:
    from jaxserve.engine.arg_utils import engine_config_from_args
    from jaxserve.serve import make_arg_parser

    args = make_arg_parser().parse_args(
        ["-tp", "2", "--max-num-batched-tokens", "2k", "--no-enable-prefix-caching",
         "--served-model-name", "a", "b", "--scheduling-policy", "priority"])
    config = engine_config_from_args(args)
    assert config.parallel_config.tensor_parallel_size == 2
    assert config.scheduler_config.max_num_batched_tokens == 2000
    assert not config.cache_config.enable_prefix_caching
    assert config.model_config.served_model_name == ("a", "b")
    assert config.scheduler_config.policy.value == "priority"


def test_derived_settings_are_decided_once() -> None:
    spec = make_engine_config(speculative_config={"num_speculative_tokens": 3})
    assert not spec.scheduler_config.async_scheduling and spec.batch_queue_size == 1
    assert make_engine_config().batch_queue_size == 2
    assert make_engine_config(async_scheduling=False).batch_queue_size == 1
    # Pipeline stages: async scheduling becomes microbatches, off for the scheduler itself.
    pp = make_engine_config(pipeline_parallel_size=2).scheduler_config
    assert (pp.num_microbatches, pp.async_scheduling) == (2, False)
    assert make_engine_config(pipeline_parallel_size=2).batch_queue_size == 2
    assert make_engine_config(pipeline_parallel_size=3).batch_queue_size == 3
    no_async = make_engine_config(pipeline_parallel_size=2, async_scheduling=False)
    assert no_async.scheduler_config.num_microbatches == 1 and no_async.batch_queue_size == 1


def test_bad_arguments_are_value_errors_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['max_num_seq'\]"):
        EngineArgs.from_kwargs(max_num_seq=4)
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        make_engine_config(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        make_engine_config(max_num_seqs=0)


def test_structured_outputs_config() -> None:
    cfg = make_engine_config(structured_outputs_config={"disable_additional_properties": True})
    assert cfg.structured_outputs_config.disable_additional_properties
    assert not make_engine_config().structured_outputs_config.disable_additional_properties
    with pytest.raises(ValueError, match=r"unknown keys \['strict'\]"):
        make_engine_config(structured_outputs_config={"strict": True})
    with pytest.raises(ValueError, match="backend must be 'guidance'"):
        make_engine_config(structured_outputs_config={"backend": "xgrammar"})


def test_pooler_config() -> None:
    assert make_engine_config().pooler_config == PoolerConfig("LAST", True)  # vLLM's defaults
    cfg = make_engine_config(pooler_config={"pooling_type": "mean", "normalize": False})
    assert cfg.pooler_config == PoolerConfig("MEAN", False)
    assert cfg.pooler_config.pooling_params() == PoolingParams("MEAN", False)
    assert cfg.pooler_config.pooling_params(normalize=True) == PoolingParams("MEAN", True)
    with pytest.raises(ValueError, match=r"unknown keys \['dimensions'\]"):
        make_engine_config(pooler_config={"dimensions": 8})
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS"):
        make_engine_config(pooler_config={"pooling_type": "STEP"})
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for flag in ("--pooler-config", "--override-pooler-config"):  # vLLM's old name too
        args = parser.parse_args([flag, '{"pooling_type": "CLS"}'])
        assert EngineArgs.from_cli_args(args).create_engine_config().pooler_config.pooling_type == "CLS"
