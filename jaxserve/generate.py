"""`python -m jaxserve.generate [PROMPT ...]`: offline generation from the command line.

Runs the same engine as the server (scheduler, worker, sampler) in-process.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.sampling_params import SamplingParams


def make_parser() -> argparse.ArgumentParser:
    """The prompts, sampling flags and every engine flag (EngineArgs)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="*", default=["Write a haiku about the sea."])
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="apply the model's chat template to each prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    EngineArgs.add_cli_args(parser, defaults={"max_model_len": 2048})
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from jaxserve.llm import LLM  # imports JAX

    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    print(f"engine ready in {time.perf_counter() - t0:.1f} s")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outs):
        print(f"\n>>> {prompt}\n{out.outputs[0].text}")


if __name__ == "__main__":
    main()
