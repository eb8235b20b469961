"""`python -m jaxserve.bench {throughput,serve} ...`"""

from __future__ import annotations

import argparse

from jaxserve.bench import online, throughput


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxserve.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    throughput.add_args(sub.add_parser("throughput", help="offline throughput (LLM.generate)"))
    online.add_args(sub.add_parser("serve", help="online serving (any OpenAI-compatible server)"))
    args = parser.parse_args(argv)
    if args.command == "throughput":
        throughput.run(args)
    elif args.command == "serve":
        online.run(args)


if __name__ == "__main__":
    main()
