"""``vllm-dp bench prompt-answers``: answer accuracy of a real model on privatized questions.

What SmolLM2-135M-Instruct answers (its chat template; its public input embeddings are the table) when
the user's question is privatized by the plugin's own service as the server runs it. Questions: the
scenarios of ``benchmarks/data/context-scenarios.jsonl`` (``public``: no system prompt; ``shared``,
``secret``: the documents as a plain system prompt); only the question's tokens are private. Rows: the
un-privatized question (``reference``), the question removed (``no_question``, the eps -> 0 end) and
every entry of ``privatizers.PRIVATIZERS`` at each per-token eps (metric DP at eps_m = eps / Delta,
reproductions at their claimed eps, a failed calibration as an n/a row). ``experiment.run`` answers a
row greedily in one ``generate`` call and scores it; ``report`` writes ``prompt-answers-*.{md,json,png}``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..lib.cli import add_date_arg, add_out_arg, add_quick_arg, command_line, floats, names, parse
from ..lib.scenarios import DEFAULT_MODEL
from .experiment import describe, run
from .privatizers import BASELINES, PRIVATIZERS
from .settings import QUICK, Settings


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The suite's options on ``parser``."""
    p = parser
    add_quick_arg(p, "smoke test: laplace + trlap_corrected at eps 20 and 200, 3 scenarios")
    add_out_arg(p)
    p.add_argument("--model", help=f"chat model directory (default {DEFAULT_MODEL})")
    p.add_argument("--scenarios", help="scenarios JSONL (default the bundled context-scenarios.jsonl)")
    p.add_argument("--limit", type=int, help="first N scenarios only (default all 24)")
    p.add_argument("--mechanisms", type=names,
                   help=f"comma list (default all: {','.join(m for m in PRIVATIZERS if m not in BASELINES)}); "
                        f"the {' and '.join(BASELINES)} rows always run")
    p.add_argument("--eps", dest="epsilons", type=floats, help="per-token eps grid (default 5,10,20,50,100,200)")
    p.add_argument("--seed", type=int, help="noise seed (default 0)")
    p.add_argument("--delta", type=float, help="per-token delta of trlap_corrected/gaussian_analytic (default 1e-6)")
    add_date_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar or log lines")
    p.add_argument("--append", action="store_true",
                   help="merge these rows into the day's saved results (same questions): replaces rows of the same (mechanism, eps)")
    return p


def build_parser() -> argparse.ArgumentParser:
    """``vllm-dp bench prompt-answers``' parser."""
    return add_cli_args(argparse.ArgumentParser(prog="vllm-dp bench prompt-answers", description=(
        "Answer accuracy of SmolLM2-135M-Instruct on questions privatized per token by the plugin's prompt "
        "privacy service, every mechanism vs per-token eps and vs the receipt's total eps, with the "
        "un-privatized question as reference. Writes md/json/png.")))


def settings_from_args(args: argparse.Namespace, argv: Sequence[str] | None) -> Settings:
    """The ``Settings`` of parsed options (``--quick``'s sizes where an option is not given)."""
    given = {k: getattr(args, k) for k in ("model", "scenarios", "limit", "mechanisms", "epsilons", "seed", "delta")
             if getattr(args, k) is not None}
    return Settings(**{**(QUICK if args.quick else {}), **given}, out=args.out, quick=args.quick,
                    progress=not args.no_progress, append=args.append, date=args.date,
                    command=command_line("vllm-dp bench prompt-answers", argv))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``vllm-dp bench prompt-answers ...``)."""
    args, argv = parse(args, build_parser)
    results = run(settings_from_args(args, argv))
    runtime = f"runtime {results['runtime_s'] / 60:.1f} min; results:"
    print("", *map(describe, results["rows"]), *results["notes"], runtime, *(f"  {p}" for p in results["files"]), sep="\n")
    return 0
