"""``python -m benchmarks.make_scenarios OUT``: write generated private-context scenarios (a held-out
set for ``vllm-dp bench context --scenarios OUT``; the bundled set is ``--seed 0``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from benchmarks import with_example
from benchmarks.lib.scenario_generator import STYLES, make_scenarios, write_scenarios
from vllm_dp_plugin.benchmarks.lib.cli import parse


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("out", type=Path, help="the JSONL file to write")
    parser.add_argument("--count", type=int, default=24, help="scenarios to generate (default 24)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (the bundled set is seed 0)")
    parser.add_argument("--style", choices=tuple(STYLES), default="realistic",
                        help="realistic (the bundled set) or simple (the set bundled before the realistic one)")
    return parser


@with_example
def build_parser(prog: str = "python -m benchmarks.make_scenarios") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    args, _ = parse(args, build_parser)
    path = write_scenarios(make_scenarios(args.count, args.seed, args.style), args.out)
    print(f"{args.count} {args.style} scenarios (seed {args.seed}) written to {path}; run them with "
          f"`vllm-dp bench context --scenarios {path}`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
