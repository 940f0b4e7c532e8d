"""``vllm-dp bench context``: does a private context still inform answers, and does it leak?

A real chat model is asked questions about a set of short documents served as its context:

* ``shared``: a fact stated (paraphrased) by ``support`` documents, support in {1, 3, 10, 20};
  what a private context should still deliver when many documents agree;
* ``secret``: a fact stated by exactly one document (the leak canary): what DP should hide;
* ``public``: a question that needs no context (capital cities, arithmetic): whether the context,
  private or not, makes ordinary answers worse.

An answer is correct when any of the question's ``answers`` occurs (case-insensitive, as a whole
phrase, or as the same words apart from punctuation: ``scenarios.answer_in``) in the first 32 greedy tokens (``temperature 0``, ``max_tokens 32``). Rows whose responses
carry a DP receipt (``aggregate_answer``) are also judged on what they release and say
(``scoring``'s docstring has the exact rules): the **wrong-release rate** (shared and secret
questions whose reply states a released fact that is not the answer), the **fragment rate**
(a released part of the answer: "12" for "Room 12"), and their **fallbacks** (nothing released):
the share not marked as not from the documents (``aggregate.reply.NOT_FROM_DOCUMENTS``, then
``GENERAL_KNOWLEDGE`` before a public answer) and the share that states a specific the question
does not. Every row: the **unsupported-specific rate** (replies to shared and secret questions
that add a number, date or name found in neither the question nor the released fact; ``full``:
nor the documents).

Rows (``ROWS``, one entry per way of serving; a new mechanism is one more entry):

* ``none``: no context, the user turn alone (stock vLLM);
* ``full``: the documents in plain text before the user turn (stock vLLM, exact attention);
* ``dp_state`` / ``dp_tree``: the documents as the private context (``vllm-dp serve``, DP
  attention, mode ``state`` / ``tree``, default settings: public head ``auto``, gate 0.5), at
  each eps of ``--eps`` (eps = 1e7 shows the kernel error alone; accounted with ``basic``
  composition, which PLD refuses beyond eps = 100); the levers one by one:
  ``dp_state_head`` (public head, gate off), ``dp_state_bare`` / ``dp_tree_bare`` (no public
  head, no gate: every context token private and every release read, the paper's setting);
  ``dp_state_doc`` / ``dp_state_doc_open``: unit document (each scenario's collection, one slot
  of 64 tokens per document, documents encoded independently), default gate / gate off;
* ``aggregate_vote`` / ``aggregate_expmech``: DP aggregation at the output (``dp_privacy.aggregate``
  with the recommended settings), each scenario's documents one collection, eps per query; the
  request is the user turn alone (the public sequence; members get their documents before it);
  ``aggregate_answer``: the same collections under ``mechanism: answer`` (one DP release per
  answer; eps = 1e7 is its noise-free row: threshold 2, no noise); ``aggregate_answer_batch``: the
  same with exactly 16 members run per query, those whose documents can answer
  (``answer_batch: 16``, l0 = 2); ``aggregate_extract``: the
  same with ``answer_member: extract`` (no model runs for a member: each reads its document).

Time per output token and seconds per answer are a research suite of the repository:
``python -m benchmarks.context_speed`` (over this suite's rows and servers).

Every row sees the same token sequence: ``C`` = the chat template's system turn holding the
documents (one per line), then the user turn with the generation prompt; ``none`` drops ``C``.
The DP renderer puts ``C`` at positions [0, P) and the request's own ids after it, so DP rows
send only the user turn (token ids; a leading BOS that the renderer would drop is doubled) and
pick the scenario's context with ``vllm_xargs: {"dp_context": ID}``. Each request's
``usage.prompt_tokens`` is checked against the expected length.

One server per (row, eps) (rows with the same server, ``none`` and ``full``, share one; a row
with ``contexts_per_server`` splits the scenarios over several servers: ``dp_tree``'s releases
are GBs), 8 requests in flight. DP rows use a key file and a release ledger in a temporary
directory of the run (never the operator's) and a calibration of the model on public text, cached
in ``--cache-dir``. Writes ``context-<device>-<date>.{md,json,png}`` into ``--out``
(``context-quick-...`` for ``--quick``, ``context-<scenarios file stem>-...`` for another
``--scenarios``); the JSON keeps every answer (``sample_answers``: question, reply, released fact,
its class, the specifics it adds) and the scenarios file's sha256; with
``--append`` the rows of an existing file of that name that this run does not measure are kept
(add one mechanism without re-running the others).

Scenarios: ``vllm_dp_plugin/benchmarks/data/context-scenarios.jsonl`` (24, generated with seed 0,
style ``realistic``, by the repository's ``python -m benchmarks.make_scenarios``: companies with several sites, teams and products,
30 documents of 2-4 sentences behind headers with ids, the asked property also stated for other
entities, answers with common words; the set bundled before issue 48 is
``data/context-scenarios-simple.jsonl``, ``--style simple``). A held-out set that nobody tunes
to: ``python -m benchmarks.make_scenarios OUT --seed 101`` (any other seed), then ``--scenarios OUT``; its results
are named ``context-<file stem>-<device>-<date>``. One JSON object per line::

    {"id": str, "documents": [str, ...],
     "questions": [{"q": str, "answers": [str, ...], "kind": "shared" | "secret" | "public",
                    "support": int}, ...]}

``answers`` are the accepted surface forms ("Room 12", "room 12"), the documents' own first.

The suite is a package: ``scoring`` (answers, result rows),
``rows`` (``ROWS``: servers and requests), ``report`` (markdown, plot), ``running`` (``Bench``,
servers, ``run``) and here ``add_cli_args`` and ``main``. Run it as
``vllm-dp bench context`` or ``python -m vllm_dp_plugin.benchmarks.context``.
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
from collections.abc import Sequence
from pathlib import Path

from vllm_dp_plugin.benchmarks.context.report import KERNEL_ONLY_EPS, markdown, plot
from vllm_dp_plugin.benchmarks.context.rows import ROWS
from vllm_dp_plugin.benchmarks.context.running import Bench, jobs_of, run
from vllm_dp_plugin.benchmarks.lib.cli import DEFAULT_OUT, parse, today
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


def build_parser(prog: str = "vllm-dp bench context") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))


def kept_rows(path: Path | None, model: str, scenarios: str, max_tokens: int,
              jobs: Sequence[tuple[str, float | None]], scenarios_sha256: str | None = None) -> dict:
    """``--append``: what an earlier result file at ``path`` keeps (its rows, budget statements and
    sample answers that ``jobs`` does not re-measure, and its commands); it must be of the same
    model, scenarios file (and its content, where the file records its digest) and answer length
    (``--limit`` may differ: rows state their questions). Files written before a field existed
    are read as they are (rows without the release metrics show them empty)."""
    if path is None or not path.exists():
        return {"rows": [], "budgets": [], "sample_answers": [], "commands": []}
    old = json.loads(path.read_text())
    same = {"model": model, "scenarios": scenarios, "max_tokens": max_tokens}
    if scenarios_sha256 is not None and old.get("scenarios_sha256") is not None:
        same["scenarios_sha256"] = scenarios_sha256
    if any(old.get(k) != v for k, v in same.items()):
        raise SystemExit(f"--append: {path} was measured with "
                         f"{ {k: old.get(k) for k in same} }, this run with {same}; choose another --out")
    again = set(jobs)

    def keep(item):
        return (item["row"], item["eps"]) not in again

    return {"rows": [r for r in old["rows"] if keep(r)], "budgets": [b for b in old.get("budgets", []) if keep(b)],
            "sample_answers": [a for a in old.get("sample_answers", []) if keep(a)],
            "commands": [*old.get("earlier_commands", []), old["command"]]}


def result_stem(out: Path, quick: bool, scenarios: Path, device: str, date: str) -> Path:
    """Where a run's results go: ``context[-quick][-<scenarios file stem>]-<device>-<date>``, the
    file's stem only when it is not the bundled set (a held-out set never overwrites its results)."""
    own = [] if Path(scenarios).resolve() == DEFAULT_SCENARIOS.resolve() else [Path(scenarios).stem]
    return Path(out) / "-".join(["context", *(["quick"] if quick else []), *own, device, date])


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed arguments (``add_cli_args``) or an argv list (``vllm-dp bench context ...``)."""
    args, argv = parse(args, build_parser)
    rows = [r for r in args.rows.split(",") if r]
    eps = [float(e) for e in args.eps.split(",") if e]
    every = load_scenarios(args.scenarios)  # the file's: the report's header describes them all
    scenarios = every[:args.limit]
    max_tokens = ANSWER_TOKENS
    if args.quick:
        scenarios, eps, max_tokens = scenarios[:2], [8.0], 8
    elif KERNEL_ONLY_EPS not in eps:
        eps.append(KERNEL_ONLY_EPS)
    jobs_of(rows, eps)  # unknown rows fail before anything starts
    model = ensure_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-dp-bench-context-"))
    bench = Bench(model, scenarios, work, args.cache_dir, max_tokens, args.concurrency)
    started = time.perf_counter()
    date = today()
    device = device_label(default_device())  # the device vLLM serves on
    command = "vllm-dp bench context" + ("" if argv is None else " " + " ".join(argv))
    questions = [q for s in every for q in s["questions"]]
    by_support = {}
    for q in questions:
        if q["kind"] == "shared":
            by_support[str(q["support"])] = by_support.get(str(q["support"]), 0) + 1
    digest = hashlib.sha256(Path(args.scenarios).read_bytes()).hexdigest()
    stem = result_stem(args.out, args.quick, args.scenarios, device, date)

    kept = kept_rows(suffixed(stem, ".json") if args.append else None, model, shown(args.scenarios), max_tokens,
                     jobs_of(rows, eps), digest)

    def write(results, budgets, samples) -> None:
        data = {"model": model, "device": device, "date": date, "scenarios": shown(args.scenarios),
                "scenarios_sha256": digest, "rows": kept["rows"] + results,
                "command": command.strip(), "earlier_commands": kept["commands"],
                "platform": platform.platform(), "n_scenarios": len(every),
                "question_counts": {k: sum(q["kind"] == k for q in questions) for k in KINDS},
                "question_counts_by_support": by_support, "max_tokens": max_tokens,
                "concurrency": args.concurrency, "budgets": kept["budgets"] + budgets,
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
