"""`python -m jaxserve.serve`'s command line as a vLLM user types it: positional model, sizes
like 8k / 2GiB, defaults in --help, the default model by name, a port in use reported before
anything loads; and the periodic stats line."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import msgpack
import pytest
from prometheus_client import generate_latest

from jaxserve.api_server.server_args import json_list, read_chat_template
from jaxserve.engine.arg_utils import engine_config_from_args, human_readable_int
from jaxserve.engine_core.spec_decode import SpecDecodingStats
from jaxserve.engine_core.stats import SchedulerStats
from jaxserve.engine_core.wire import decode_record, encode_record
from jaxserve.metrics.prometheus import LoggingStatLogger, ServerMetrics
from jaxserve.models.model_files import DEFAULT_MODEL_NAME, default_model_path, resolve_model
from jaxserve.serve import make_arg_parser

from .server_utils import ROOT


def test_sizes_follow_vllms_rule() -> None:
    assert human_readable_int("4096") == 4096
    assert human_readable_int("8k") == 8000 and human_readable_int("8K") == 8192
    assert human_readable_int("2GiB") == human_readable_int("2G") == 2 << 30
    assert human_readable_int("2GB") == 2 * 10**9 and human_readable_int("1.5k") == 1500
    for bad in ("two", "1.5K7", "-3", "0.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            human_readable_int(bad)
    assert json_list('["http://a", "http://b"]') == ["http://a", "http://b"]
    with pytest.raises(argparse.ArgumentTypeError):
        json_list("*")


def test_positional_model_and_the_default_models_name() -> None:
    args = make_arg_parser().parse_args(["some/model", "--max-model-len", "8k",
                                         "--kv-cache-memory-bytes", "256MiB"])
    assert args.model_tag == "some/model" and args.max_model_len == 8000
    assert args.kv_cache_memory_bytes == 256 << 20
    assert resolve_model(DEFAULT_MODEL_NAME).path == default_model_path()
    # The engine core's grammars read the same tokenizer as the API server.
    args = make_arg_parser().parse_args(["--model", "m", "--tokenizer", "some/tokenizer"])
    assert engine_config_from_args(args).model_config.tokenizer == "some/tokenizer"
    # Quantization flags reach the engine config under vLLM's names.
    config = engine_config_from_args(make_arg_parser().parse_args(
        ["-q", "int8", "--kv-cache-dtype", "fp8"]))
    assert config.model_config.quantization == "int8" and config.cache_config.cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["--kv-cache-dtype", "int4"])


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve.serve", *args], cwd=ROOT,
                          env=dict(os.environ, **(env or {})), capture_output=True, text=True,
                          timeout=120)


def test_help_shows_defaults_but_not_the_api_key() -> None:
    out = _serve("--help", env={"JAXSERVE_API_KEY": "sekrit-123"})
    assert out.returncode == 0
    assert "(default: 64)" in out.stdout and "sekrit-123" not in out.stdout


def test_two_different_models_and_a_port_in_use_are_usage_errors() -> None:
    out = _serve("a.gguf", "--model", "b.gguf")
    assert out.returncode == 2 and "two models" in out.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        t0 = time.monotonic()
        out = _serve("--port", str(s.getsockname()[1]))
    assert out.returncode == 2 and "cannot listen on 127.0.0.1" in out.stderr, out.stderr
    assert "engine core" not in out.stderr  # refused before anything started loading
    print(f"port in use reported after {time.monotonic() - t0:.1f} s")


def test_stat_logger_line() -> None:
    m = ServerMetrics("m")
    log = LoggingStatLogger(m, now=0.0)
    assert log.line(now=10.0) is None  # idle: quiet
    stats = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25)
    stats.prefix_cache_stats.queries, stats.prefix_cache_stats.hits = 100, 40
    m.record_scheduler_stats(stats)
    m.totals["prompt_tokens"] += 500
    m.totals["generation_tokens"] += 200
    line = log.line(now=20.0)
    assert line == ("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 20.0 "
                    "tokens/s, Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 40.0%"), line
    # Speculative decoding: vLLM's counters on /metrics and its part of the line.
    spec = SpecDecodingStats(3)
    spec.observe(3, 3)
    spec.observe(3, 1)
    m.record_scheduler_stats(SchedulerStats(num_running_reqs=1, spec_decoding_stats=spec))
    line = log.line(now=30.0)
    assert line.endswith("SpecDecoding: Mean acceptance length: 3.00, Accepted: 4 tokens, "
                         "Drafted: 6 tokens, Draft acceptance rate: 66.7%"), line
    text = generate_latest(m.registry).decode()
    # vLLM's labels: the model and the engine's index on every series.
    for sample in ('vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 2.0',
                   'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 6.0',
                   'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 4.0',
                   'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 2.0',
                   'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0',
                   'vllm:num_requests_running{engine="0",model_name="m"} 1.0'):
        assert sample in text, sample
    # The stats survive the trip from the engine-core process (jaxserve/engine_core/wire.py).
    wire = msgpack.unpackb(msgpack.packb(encode_record(SchedulerStats(spec_decoding_stats=spec))))
    assert decode_record(SchedulerStats, wire).spec_decoding_stats == spec


def test_generation_defaults_and_chat_template_sources(tmp_path) -> None:
    import json

    from jaxserve.models.model_files import ModelFiles, ModelFormat, generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_length": 99}))
    files = ModelFiles(str(tmp_path), ModelFormat.HF, "m")
    assert generation_defaults(files) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.0}
    assert generation_defaults(resolve_model(None)) == {}  # a GGUF has none
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(template)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{{ 'x' }}") == "{{ 'x' }}"
    with pytest.raises(argparse.ArgumentTypeError):
        read_chat_template("no-such-file.jinja")


def test_bad_tokenizer_generation_config_and_max_logprobs_are_usage_errors() -> None:
    for args, words in ((["--tokenizer", "/no/such/tok"], "--tokenizer"),
                        (["--generation-config", "/no/such/dir"], "--generation-config"),
                        (["--max-logprobs", "50"], "--max-logprobs"),
                        (["--chat-template", "nope.jinja"], "--chat-template"),
                        (["--enable-auto-tool-choice"], "--tool-call-parser"),
                        (["--tool-call-parser", "nope"], "--tool-call-parser"),
                        (["--skip-tokenizer-init", "--chat-template", "{{ 1 }}"], "needs a tokenizer"),
                        (["--speculative-config", "[1]"], "--speculative-config"),
                        (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens")):
        out = _serve(*args)
        assert out.returncode == 2 and words in out.stderr, (args, out.stderr)
    # Multi-host settings a follower cannot work with are usage errors too.
    two = {"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"}
    for args, env, words in ((["-dp", "2"], two, "--data-parallel-size"),
                             ([], dict(two, JAX_PROCESS_ID="5"), "JAX_PROCESS_ID"),
                             ([], {"JAX_NUM_PROCESSES": "2"}, "coordinator address")):
        out = _serve(*args, env=env)
        assert out.returncode == 2 and words in out.stderr, (args, env, out.stderr)
