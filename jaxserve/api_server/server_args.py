"""The API server's settings (vLLM's `FrontendArgs`): decided once from the command line, typed
and frozen, beside the EngineConfig. `run_server` reads these two records and nothing else.

JAX-free: `python -m jaxserve.serve` builds it before any process starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field

from jaxserve.api_server.reasoning_parsers import REASONING_PARSERS
from jaxserve.api_server.tool_parsers import TOOL_PARSERS
from jaxserve.config import EngineConfig
from jaxserve.engine.arg_utils import add_dataclass_args, cli_arg
from jaxserve.sampling_params import MAX_LOGPROBS

API_KEY_ENV = "JAXSERVE_API_KEY"  # vLLM's VLLM_API_KEY: --api-key's fallback


def json_list(value: str) -> list[str]:
    """A JSON list of strings (vLLM's --allowed-origins form)."""
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return parsed


def read_chat_template(value: str) -> str:
    """--chat-template: a file's contents, or the argument itself (vLLM's rule)."""
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" not in value:
        raise argparse.ArgumentTypeError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


@dataclass(frozen=True)
class ServerArgs:
    """Each field is the flag of its name (`--uvicorn-log-level`, ...); its default is the
    flag's."""

    host: str = field(default="127.0.0.1", metadata=cli_arg("server", "use 0.0.0.0 to listen on every interface"))
    port: int = field(default=8000, metadata=cli_arg("server", "port to listen on", type=int))
    uvicorn_log_level: str = field(default="info", metadata=cli_arg("server",
        "uvicorn's own log level", choices=["debug", "info", "warning", "error", "critical"]))
    disable_uvicorn_access_log: bool = field(default=False, metadata=cli_arg("server",
        "no log line per HTTP request", action="store_true"))
    disable_log_stats: bool = field(default=False, metadata=cli_arg("server",
        "no periodic throughput / KV-usage log line", action="store_true"))
    # NOTE: the environment is read after parsing: --help must not print the key.
    api_key: str | None = field(default=None, metadata=cli_arg("server",
        "require `Authorization: Bearer <key>` on every /v1 route "
        f"(or set ${API_KEY_ENV}; neither: no authentication)"))
    trust_request_chat_template: bool = field(default=False, metadata=cli_arg("server",
        "accept chat templates sent in requests (their cost is unbounded)", action="store_true"))
    chat_template: str | None = field(default=None, metadata=cli_arg("server",
        "a Jinja chat template (a file, or the template itself) replacing the tokenizer's"))
    generation_config: str = field(default="auto", metadata=cli_arg("server",
        "sampling defaults: auto (the model's generation_config.json), vllm (none: vLLM's own "
        "defaults) or a folder holding one"))
    max_logprobs: int = field(default=MAX_LOGPROBS, metadata=cli_arg("server",
        f"most logprobs / prompt_logprobs a request may ask for (at most {MAX_LOGPROBS})", type=int))
    root_path: str | None = field(default=None, metadata=cli_arg("server",
        "the path prefix a reverse proxy serves this API under"))
    enable_auto_tool_choice: bool = field(default=False, metadata=cli_arg("server",
        'let the model call tools on its own (tool_choice "auto"); needs --tool-call-parser', action="store_true"))
    tool_call_parser: str | None = field(default=None, metadata=cli_arg("server",
        "how the model writes tool calls (hermes/qwen: <tool_call> tags; llama3_json; "
        "mistral: [TOOL_CALLS]; openai: GPT-OSS's harmony messages to functions.*, which "
        "implies --reasoning-parser openai_gptoss)", choices=sorted(TOOL_PARSERS)))
    reasoning_parser: str | None = field(default=None, metadata=cli_arg("server",
        "split the reply's reasoning into the message's reasoning field (deepseek_r1, qwen3: "
        "<think>...</think>; openai_gptoss: GPT-OSS's harmony analysis channel)",
        choices=sorted(REASONING_PARSERS)))
    enable_prompt_tokens_details: bool = field(default=False, metadata=cli_arg("server",
        "report usage.prompt_tokens_details.cached_tokens (the prompt tokens the prefix cache "
        "served) in completions and chat completions; the Messages and Responses APIs always "
        "report them",
        action="store_true"))
    responses_store_size: int = field(default=256, metadata=cli_arg("server",
        "the Responses API keeps this many responses (store=true) in memory for GET, "
        "previous_response_id and background polling; the oldest is evicted first; 0: none",
        type=int))
    allowed_origins: tuple[str, ...] = field(default=("*",), metadata=cli_arg("server",
        "CORS: origins allowed to call the API (a JSON list)", type=json_list))
    allowed_methods: tuple[str, ...] = field(default=("*",), metadata=cli_arg("server",
        "CORS methods", type=json_list))
    allowed_headers: tuple[str, ...] = field(default=("*",), metadata=cli_arg("server",
        "CORS headers", type=json_list))
    allow_credentials: bool = field(default=False, metadata=cli_arg("server", "CORS credentials", action="store_true"))
    otlp_traces_endpoint: str | None = field(default=None, metadata=cli_arg("server",
        "export each request's trace as OpenTelemetry spans to this OTLP HTTP endpoint (e.g. "
        "http://127.0.0.1:4318/v1/traces; needs the otel extra)", metavar="URL"))

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_args(parser, cls)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, config: EngineConfig) -> ServerArgs:
        """The record, with --chat-template's text read and the API key's environment
        fallback; ValueError naming the flag for a value or a combination that cannot work."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        values["api_key"] = values["api_key"] or os.environ.get(API_KEY_ENV) or None
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            values[name] = tuple(values[name])
        if config.model_config.skip_tokenizer_init:
            given = [flag for flag, value in (("--tokenizer", config.model_config.tokenizer),
                                              ("--chat-template", values["chat_template"]),
                                              ("--tool-call-parser", values["tool_call_parser"]),
                                              ("--reasoning-parser", values["reasoning_parser"]))
                     if value is not None]
            if given:
                raise ValueError(f"--skip-tokenizer-init serves token ids only: {', '.join(given)} "
                                 "needs a tokenizer")
        if values["chat_template"] is not None:
            try:
                values["chat_template"] = read_chat_template(values["chat_template"])
            except (argparse.ArgumentTypeError, OSError) as e:
                raise ValueError(str(e)) from None
        if not 0 <= values["max_logprobs"] <= MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the sampler computes "
                             f"{MAX_LOGPROBS}), got {values['max_logprobs']}")
        if values["otlp_traces_endpoint"]:
            if not config.request_tracing:
                raise ValueError("--otlp-traces-endpoint needs request tracing (drop --no-request-tracing)")
            try:
                import opentelemetry.sdk  # noqa: F401
            except ImportError:
                raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: "
                                 "pip install -e '.[otel]'") from None
        if values["enable_auto_tool_choice"] and values["tool_call_parser"] is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        tool, reasoning = values["tool_call_parser"], values["reasoning_parser"]
        own = TOOL_PARSERS[tool].reasoning_parser if tool else None
        if own is not None and reasoning not in (None, own):
            raise ValueError(f"--tool-call-parser {tool} reads a format that --reasoning-parser "
                             f"{own} splits (implied when not given), not {reasoning}")
        # Decided here, once: harmony replies are split as openai_gptoss splits them (vLLM
        # reports every GPT-OSS reply's analysis as reasoning), with or without tools.
        values["reasoning_parser"] = reasoning or own
        if values["responses_store_size"] < 0:
            raise ValueError(f"--responses-store-size must be >= 0, got {values['responses_store_size']}")
        gc = values["generation_config"]
        if gc not in ("auto", "vllm") and not os.path.isdir(gc):
            raise ValueError(f"--generation-config: {gc!r} is neither auto, vllm nor a folder")
        return cls(**values)
