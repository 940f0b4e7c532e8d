"""``vllm-dp bench prompt-answers``: answer accuracy of a real model on privatized questions.

The repository's ``python -m benchmarks.prompt`` measures prompt privatization as token preservation on MiniLM's
vocabulary; this suite asks what a real chat model answers when the user's question has been
privatized by the plugin's own service, exactly as the server runs it:

* model: SmolLM2-135M-Instruct (``.models/smollm2-135m-instruct``), its own chat template and its
  own public input-embedding table (49,152 x 576) as the privatization table;
* questions: the scenarios of ``benchmarks/data/context-scenarios.jsonl`` (``lib.scenarios``):
  ``public`` questions are asked with no system prompt (the template's default), ``shared`` and
  ``secret`` questions with the scenario's documents as a plain system prompt, one per line. The
  documents are NOT private here: only the user's question is;
* private tokens: the question's own tokens, located as the server's renderer does
  (``prompt.segments.mark_user_texts`` + ``segment_chat``: the template rendered with the text and
  with a sentinel, every piece tokenised on its own); the template and system prompt pass through;
* privatization: ``serving.prompt_table.build_prompt_privacy(model, tokenizer,
  PromptPrivacyConfig(...), None)`` and ``service.privatize(segments, service.options({"dp_mechanism":
  m, "dp_epsilon": eps}), seed=...)``, the noise seeded per (mechanism, eps, question);
* generation: offline ``vllm.LLM`` (float32, eager, greedy, ``scenarios.ANSWER_TOKENS`` tokens),
  the token ids of every prompt of a row in one ``generate`` call; an answer is correct when one
  of the question's answers occurs in it (``scenarios.is_correct``).

Rows: the un-privatized question (``reference``), the question removed (``no_question``: an empty
user turn, the eps -> 0 end: what the documents alone give) and every mechanism of ``prompt.MECHANISMS`` at
each per-token eps of the grid. The metric-DP mechanisms (``mahalanobis``, ``cmp``) are run at
metric epsilon ``eps_m = eps / Delta`` (Delta the table's diameter in the mechanism's metric) so
that the per-token eps they guarantee equals the grid value; ``trlap_paper`` / ``trlap_repro`` are
reproductions whose claimed delta is false (not DP): they are labelled and plotted at the claimed
eps. A calibration that fails at some eps (e.g. ``trlap_corrected`` overflowing) is a row with its
error, shown as n/a.

Each row's privatizer is an entry of ``PRIVATIZERS``: ``fn(bench, eps, questions) -> [Privatized]``
(the question's privatized user-text ids, any length, and the receipt as ``PromptReceipt.to_json()``),
with the loaded engine at ``bench.llm`` (``bench.outputs(prompts, SamplingParams)``,
``bench.generate``), the tokenizer and the model's ``PromptPrivacy`` service. A contextual
mechanism that rewrites the question with the model itself is one more entry, e.g.::

    def paraphrase(bench, eps, questions):
        rewrite = [rewrite_prompt_ids(bench.tokenizer, q.text) for q in questions]  # public instruction
        outs = bench.outputs(rewrite, SamplingParams(max_tokens=CAP, logits_processors=...))
        return [Privatized(tuple(o.outputs[0].token_ids), receipt_json(eps, len(o.outputs[0].token_ids)))
                for o in outs]

    PRIVATIZERS["paraphrase"] = paraphrase

and runs by default (every registered privatizer does); the harness splices the new user text
between the template pieces, scores the answers and plots the row at its per-token eps and at
its receipt's total eps. "Tokens unchanged" is positional, so read it loosely for a rewrite.

Writes ``prompt-answers-<device>-<date>.{md,json,png}`` into ``--out``.

The suite is a package: ``settings`` (``Settings``, the engine's arguments), ``questions``,
``privatizers`` (``Bench``, ``PRIVATIZERS``), ``rows`` (result rows), ``experiment`` (``run``),
``report`` (result files, markdown, plot) and here ``add_cli_args`` and ``main``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.cli import (
    add_date_arg,
    add_out_arg,
    add_quick_arg,
    command_line,
    floats,
    names,
    parse,
)
from vllm_dp_plugin.benchmarks.lib.report import read_json
from vllm_dp_plugin.benchmarks.lib.scenarios import DEFAULT_MODEL
from vllm_dp_plugin.benchmarks.prompt_answers.experiment import describe, run
from vllm_dp_plugin.benchmarks.prompt_answers.privatizers import PRIVATIZERS
from vllm_dp_plugin.benchmarks.prompt_answers.report import BASELINES, write_results
from vllm_dp_plugin.benchmarks.prompt_answers.settings import Settings


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
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
    p.add_argument("--render", type=Path, metavar="JSON", help="only re-render the markdown/plot of a saved results JSON")
    return p


def build_parser(prog: str = "vllm-dp bench prompt-answers") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(
        prog=prog,
        description="Answer accuracy of SmolLM2-135M-Instruct on questions privatized per token by the "
        "plugin's prompt privacy service, every mechanism vs per-token eps and vs the receipt's total eps, "
        "with the un-privatized question as reference. Writes md/json/png.",
    ))


def settings_from_args(args: argparse.Namespace, argv: Sequence[str] | None) -> Settings:
    base = Settings.quick_defaults() if args.quick else {}
    for key in ("model", "scenarios", "limit", "mechanisms", "epsilons", "seed", "delta"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    return Settings(out=args.out, quick=args.quick, progress=not args.no_progress, append=args.append, date=args.date,
                    command=command_line("vllm-dp bench prompt-answers", argv), **base)


def load_results(path: Path) -> tuple[dict, Settings]:
    results = read_json(path)
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in results["settings"].items()}
    saved["out"] = Path(path).parent
    known = set(Settings.__dataclass_fields__)
    return results, Settings(**{k: v for k, v in saved.items() if k in known})


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``vllm-dp bench prompt-answers ...``)."""
    args, argv = parse(args, build_parser)
    if args.render:
        results, settings = load_results(args.render)
        write_results(results, settings)
    else:
        results = run(settings_from_args(args, argv))
    print()
    for row in results["rows"]:
        print(describe(row))
    for line in results["notes"]:
        print(line)
    print(f"runtime {results['runtime_s'] / 60:.1f} min; results:")
    for path in results["files"]:
        print(f"  {path}")
    return 0
