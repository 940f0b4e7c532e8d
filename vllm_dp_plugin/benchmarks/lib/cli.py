"""The command-line shape every suite has (vLLM's benchmarks have it too): ``add_cli_args(parser)
-> parser`` adds the suite's options, ``main(args)`` runs it from a parsed Namespace or from an
argv list (``vllm-dp bench SUITE ...`` passes the list). Options several suites share are added
here, so that they read and default the same everywhere."""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

DEFAULT_OUT = Path("benchmarks/results")  # relative to the working directory

# One worked example per suite, the last lines of ``vllm-dp bench SUITE --help`` (``parse`` and
# ``with_example`` add it to the suite's parser). Quick runs write outside benchmarks/results/.
EXAMPLES = {
    "serve": "vllm-dp bench serve --quick --out /tmp/bench-serve",
    "prompt-answers": "vllm-dp bench prompt-answers --quick --out /tmp/bench-prompt-answers",
    "canary": "vllm-dp bench canary --model smollm2 --seq-len 32 --work /tmp/canary-work --out /tmp/bench-canary",
    "context": "vllm-dp bench context --quick --rows none,full,aggregate_answer --out /tmp/bench-context",
    "ledger": "vllm-dp bench ledger --quick --out /tmp/bench-ledger",
    "faults": "vllm-dp bench faults --setups attention-demo --trials 1 --out /tmp/bench-faults",
    "load": "vllm-dp bench load --modes aggregate,none --requests 100 --soak-minutes 2 --out /tmp/bench-load",
    "fuzz": "vllm-dp bench fuzz --modes aggregate --cases 100 --out /tmp/bench-fuzz",
}


class ExampleHelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that an epilog starting with ``example:`` keeps its lines (the
    worked example is printed as written, one command a line)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("example:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def example(command: str) -> str:
    """The epilog of a parser whose help ends with ``command`` (use with ``ExampleHelpFormatter``)."""
    return f"example:\n  {command}"


def with_example(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` (``prog`` ``vllm-dp bench SUITE``) with the suite's worked example as its epilog."""
    suite = parser.prog.removeprefix("vllm-dp bench ")
    if suite in EXAMPLES and not parser.epilog:
        parser.epilog = example(EXAMPLES[suite])
        if parser.formatter_class is argparse.HelpFormatter:
            parser.formatter_class = ExampleHelpFormatter
    return parser


def ints(text: str) -> tuple[int, ...]:
    """``"1024,4096"`` (or ``"1e3"``) -> (1024, 4096)."""
    return tuple(int(float(t)) for t in text.split(",") if t.strip())


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(t) for t in text.split(",") if t.strip())


def names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def add_out_arg(parser: argparse.ArgumentParser, default: Path = DEFAULT_OUT) -> argparse.ArgumentParser:
    parser.add_argument("--out", type=Path, default=default, help=f"output directory (default {default})")
    return parser


def add_quick_arg(parser: argparse.ArgumentParser, help: str) -> argparse.ArgumentParser:
    parser.add_argument("--quick", action="store_true", help=help)
    return parser


def add_device_arg(parser: argparse.ArgumentParser, default: str = "cpu",
                   help: str = "cpu or cuda[:i] (default cpu)") -> argparse.ArgumentParser:
    parser.add_argument("--device", default=default, help=help)
    return parser


def add_date_arg(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--date", default="", help="date stamp of the result files (default today)")
    return parser


def today(date: str = "") -> str:
    """``date`` when given, else today's ISO date."""
    return date or datetime.date.today().isoformat()


def parse(
    args: argparse.Namespace | Sequence[str] | None, build_parser: Callable[[], argparse.ArgumentParser]
) -> tuple[argparse.Namespace, list[str] | None]:
    """(Namespace, argv): ``args`` as parsed already (argv None), or the argv list (``sys.argv``
    when None) parsed by ``build_parser()``."""
    if isinstance(args, argparse.Namespace):
        return args, None
    argv = list(sys.argv[1:] if args is None else args)
    return with_example(build_parser()).parse_args(argv), argv


def command_line(prefix: str, argv: Sequence[str] | None, quote: bool = True) -> str:
    """The command a result file states: ``prefix`` and the arguments (when known)."""
    if not argv:
        return prefix
    return " ".join([prefix, *(shlex.quote(a) if quote else a for a in argv)])
