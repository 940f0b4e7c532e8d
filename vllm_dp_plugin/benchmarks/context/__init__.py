"""``vllm-dp bench context``: does a private context still inform answers, and does it leak?

A real chat model answers questions about each scenario's documents (``benchmarks.lib.scenarios``):
``shared`` facts stated by 1, 3, 10 or 20 documents, a ``secret`` stated by one (the leak canary),
``public`` questions that need no context. ``scoring`` judges the answers, ``rows.ROWS`` are the ways
of serving (private ones at each ``--eps`` and at 1e7: the kernel error alone), ``running`` asks every
row every question, ``report`` renders the result files. docs/private-context.md describes the suite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from vllm_dp_plugin.benchmarks.context.report import KERNEL_ONLY_EPS, markdown, plot
from vllm_dp_plugin.benchmarks.context.rows import ROWS, Bench
from vllm_dp_plugin.benchmarks.context.running import jobs_of, run
from vllm_dp_plugin.benchmarks.lib.cli import DEFAULT_OUT, command_line, floats, names, parse, today
from vllm_dp_plugin.benchmarks.lib.environment import default_device, device_label
from vllm_dp_plugin.benchmarks.lib.report import shown, suffixed, write_json, write_text
from vllm_dp_plugin.benchmarks.lib.scenarios import (
    ANSWER_TOKENS,
    DEFAULT_CACHE,
    DEFAULT_MODEL,
    DEFAULT_MODEL_NAME,
    DEFAULT_SCENARIOS,
    KINDS,
    ensure_model,
    load_scenarios,
)

DEFAULT_EPS = (1.0, 4.0, 8.0, 64.0)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The suite's options on ``parser``."""
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"Hugging Face model directory (default {DEFAULT_MODEL}, built with "
                             f"`vllm-dp import-model {DEFAULT_MODEL_NAME}` when missing)")
    parser.add_argument("--scenarios", type=Path, default=DEFAULT_SCENARIOS,
                        help="scenarios JSONL (default: the bundled 24 scenarios)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows of {', '.join(ROWS)}")
    parser.add_argument("--eps", default=",".join(f"{e:g}" for e in DEFAULT_EPS),
                        help=f"eps of the DP rows, comma-separated (eps = {KERNEL_ONLY_EPS:g} is always added)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 scenarios, eps 8 only (no 1e7), 8 answer tokens")
    parser.add_argument("--limit", type=int, metavar="N",
                        help="the first N scenarios only (a row's questions column says how many it answered)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result directory")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows (and budget statements) of an existing result file of the same name "
                             "that this run does not measure")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the calibration is cached")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The suite's own parser (``vllm-dp bench context``)."""
    return add_cli_args(argparse.ArgumentParser(prog="vllm-dp bench context", description=__doc__.splitlines()[0]))


def kept_rows(path: Path | None, model: str, scenarios: str, max_tokens: int,
              jobs: Sequence[tuple[str, float | None]], scenarios_sha256: str | None = None) -> dict:
    """``--append``: the rows, budgets and answers of the result file at ``path`` that ``jobs`` do not
    measure again, and its commands; the file must share model, scenarios (digest if stated), max tokens."""
    if path is None or not path.exists():
        return {"rows": [], "budgets": [], "sample_answers": [], "commands": []}
    old = json.loads(path.read_text())
    same = {"model": model, "scenarios": scenarios, "max_tokens": max_tokens}
    if scenarios_sha256 is not None and old.get("scenarios_sha256") is not None:
        same["scenarios_sha256"] = scenarios_sha256
    if any(old.get(k) != v for k, v in same.items()):
        raise SystemExit(f"--append: {path} was measured with "
                         f"{ {k: old.get(k) for k in same} }, this run with {same}; choose another --out")
    kept = {k: [x for x in old[k] if (x["row"], x["eps"]) not in jobs] for k in ("rows", "budgets", "sample_answers")}
    return {**kept, "commands": [*old["earlier_commands"], old["command"]]}


def result_stem(out: Path, quick: bool, scenarios: Path, device: str, date: str) -> Path:
    """``context[-quick][-<scenarios file stem, unless bundled>]-<device>-<date>`` under ``out``."""
    own = [] if Path(scenarios).resolve() == DEFAULT_SCENARIOS.resolve() else [Path(scenarios).stem]
    return Path(out) / "-".join(["context", *(["quick"] if quick else []), *own, device, date])


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed arguments (``add_cli_args``) or an argv list (``vllm-dp bench context ...``)."""
    args, argv = parse(args, build_parser)
    rows, eps = names(args.rows), list(floats(args.eps))
    every = load_scenarios(args.scenarios)  # the file's: the report's header describes them all
    scenarios = every[:args.limit]
    max_tokens = ANSWER_TOKENS
    if args.quick:
        scenarios, eps, max_tokens = scenarios[:2], [8.0], 8
    elif KERNEL_ONLY_EPS not in eps:
        eps.append(KERNEL_ONLY_EPS)
    jobs = jobs_of(rows, eps)  # unknown rows fail before anything starts
    model = ensure_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-dp-bench-context-"))
    bench = Bench(model, scenarios, work, args.cache_dir, max_tokens, args.concurrency)
    started = time.perf_counter()
    date = today()
    device = device_label(default_device())  # the device vLLM serves on
    questions = [q for s in every for q in s["questions"]]
    digest = hashlib.sha256(Path(args.scenarios).read_bytes()).hexdigest()
    stem = result_stem(args.out, args.quick, args.scenarios, device, date)
    kept = kept_rows(suffixed(stem, ".json") if args.append else None, model, shown(args.scenarios), max_tokens,
                     jobs, digest)

    def write(results, budgets, samples) -> None:
        data = {"model": model, "device": device, "date": date, "scenarios": shown(args.scenarios),
                "scenarios_sha256": digest, "rows": kept["rows"] + results,
                "command": command_line("vllm-dp bench context", argv, quote=False),
                "earlier_commands": kept["commands"], "platform": platform.platform(), "n_scenarios": len(every),
                "question_counts": {k: sum(q["kind"] == k for q in questions) for k in KINDS},
                "question_counts_by_support": dict(Counter(str(q["support"]) for q in questions
                                                           if q["kind"] == "shared")),
                "max_tokens": max_tokens, "concurrency": args.concurrency, "budgets": kept["budgets"] + budgets,
                "sample_answers": kept["sample_answers"] + samples,
                "wall_s": time.perf_counter() - started}
        write_json(suffixed(stem, ".json"), data, indent=1)
        write_text(suffixed(stem, ".md"), markdown(data))
        plot(data, suffixed(stem, ".png"))

    try:
        run(bench, rows, eps, after_row=write)
    except BaseException:
        print(f"vllm-dp bench context: logs kept in {work}", file=sys.stderr)
        raise
    print(suffixed(stem, ".md").read_text())
    shutil.rmtree(work, ignore_errors=True)
    return 0
