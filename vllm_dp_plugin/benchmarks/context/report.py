"""The report of ``vllm-dp bench context``: one line per result row, the markdown tables and the plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from vllm_dp_plugin.benchmarks.context.rows import DELTA, ROWS
from vllm_dp_plugin.benchmarks.context.scoring import RELEASE_CLASSES
from vllm_dp_plugin.benchmarks.lib.report import pyplot, save_figure, table

KERNEL_ONLY_EPS = 1e7  # noise negligible: what remains is the kernel (feature map) error


def describe(r: dict) -> str:
    """A result row in one line (the run's log)."""
    eps = "" if r["eps"] is None else f" eps={r['eps']:g}"
    if r.get("note"):
        return f"{r['row']}{eps}: {r['note']}"
    shared = ", ".join(f"s{k} {v:.2f}" for k, v in r["shared_accuracy"].items())
    more = "" if not r.get("wrong_release_rate") else (
        f" wrong release {_pair(r['wrong_release_rate'])} fragment {_pair(r['fragment_rate'])} "
        f"fallback unmarked {_pct(r.get('fallback_unmarked_rate'))} with a specific "
        f"{_pct(r.get('fallback_specific_rate'))} of {r.get('n_fallbacks')}")
    if r.get("unsupported_specific_rate") is not None:
        more += f" unsupported specific {r['unsupported_specific_rate']:.2f}"
    return (f"{r['row']}{eps}: shared [{shared}] secret leak {r['secret_leak_rate']:.2f} public "
            f"{r['public_accuracy']:.2f}{more} ({r['seconds_per_answer']:.3f} s/answer, {r['n_questions']} questions)")


def _pair(rates: dict | None) -> str:
    """shared / secret of a rate per kind ("" for rows without it: older files, rows without receipts)."""
    return "" if not rates else f"{_pct(rates.get('shared'))} / {_pct(rates.get('secret'))}"


def _cell(text: str) -> str:
    text = " ".join(text.split())
    return (text if len(text) <= 200 else text[:200] + "...").replace("|", "\\|")


def markdown(data: dict) -> str:
    """The result file's markdown: what was run, the rows, released facts, examples, sheets, budgets."""
    supports = sorted({int(k) for r in data["rows"] for k in r["shared_accuracy"]})
    counts = data["question_counts"]
    commands = " then ".join(f"`{c}`" for c in [*data.get("earlier_commands", []), data["command"]])
    lines = [f"# vllm-dp bench context ({data['device']}, {data['date']})", "",
             (f"Command: {commands}. Model: `{data['model']}`. Scenarios: `{data['scenarios']}` "
              f"({data['n_scenarios']} scenarios: {counts['shared']} shared-fact, {counts['secret']} secret and "
              f"{counts['public']} public questions; a row with fewer questions answered the first scenarios "
              f"only, `--limit`). Greedy, {data['max_tokens']} tokens; an answer is correct when one of its "
              "answers occurs in the completion (case-insensitive, as a whole phrase or as the same words apart "
              "from punctuation). `none`: no context; `full`: the documents as plain text (exact attention); "
              "`dp_*`: the documents as the private context (DP attention), eps for the whole model per context, "
              f"delta = {DELTA:g}; eps = 1e7 leaves the kernel error alone; `aggregate_*`: DP aggregation "
              "at the output over the documents as a collection (unit: one document), eps per query; "
              "`fact_sheet`: a DP fact sheet released once per collection (unit: one document, eps per "
              "collection), asked through the chat API. Seconds per answer: wall time of the row's requests "
              f"({data['concurrency']} in flight) / questions, server start excluded."), "",
             ("Released facts (rows with DP receipts, `aggregate_answer`; `benchmarks/context/scoring.py`): "
              "wrong release = the share of shared (secret) questions whose reply states a released fact "
              "that is not the answer (another entity's value, a header's word), fragment = a released part "
              "of the answer (\"12\" for \"Room 12\"); unsupported specific = the share of shared and secret "
              "questions whose reply adds a number, month or weekday or capitalised name that is in neither "
              "the question nor the released fact (`full`: nor the documents); fallback unmarked = the share "
              "of replies with nothing released that do not start with the mechanism's not-from-the-documents "
              "text (and mark a public answer as general knowledge); fallback specific = the share of shared "
              "and secret fallbacks that state a specific the question does not."), "",
             table(["row", "eps", *(f"shared, support {s}" for s in supports), "secret leak rate", "public accuracy",
                    "wrong release, shared / secret", "fragment, shared / secret", "unsupported specific",
                    "fallback unmarked", "fallback specific (of)", "s / answer", "questions"],
                   [_cells(r, supports) for r in data["rows"]])]
    released = [r for r in data["rows"] if r.get("releases")]
    if released:
        groups = list(dict.fromkeys(g for r in released for g in r["releases"]))
        cells = [[" / ".join(str(r["releases"][g][c]) for c in RELEASE_CLASSES) if g in r["releases"] else ""
                  for g in groups] for r in released]
        lines += ["", ("Released facts per question (right / fragment / wrong / nothing released), by support "
                       "of the asked fact:"), "",
                  table(["row", "eps", *(g if not g.isdigit() else f"support {g}" for g in groups)],
                        [[r["row"], f"{r['eps']:g}", *c] for r, c in zip(released, cells, strict=True)])]
    lines += _examples(data)
    sheets = [r for r in data["rows"] if r.get("sheet")]
    if sheets:
        recall = sorted({k for r in sheets for k in r["sheet"]["recall"]}, key=int)
        lines += ["", ("Fact sheets (`fact_sheet` rows): facts released per collection, and the shared facts whose "
                       "answer is on their collection's sheet (recall), by support:"), "",
                  table(["row", "eps", "facts per collection", *(f"recall, support {k}" for k in recall)],
                        [[r["row"], f"{r['eps']:g}", f"{r['sheet']['facts_per_collection']:.2f}",
                          *(_pct(r["sheet"]["recall"].get(k)) for k in recall)] for r in sheets])]
    if data.get("budgets"):
        lines += ["", "DP budget statements (`GET /v1/dp/budget`, first context):", "",
                  table(["row", "eps", "context tokens", "spent eps", "guaranteed kernel error per layer",
                         "logit bound T (max)"], [[b["row"], f"{b['eps']:g}", *_budget(b)] for b in data["budgets"]])]
    return "\n".join(lines) + "\n"


def _cells(r: dict, supports: Sequence[int]) -> list[str]:
    """A result row's cells in the main table (a row that could not run: its note, the rest empty)."""
    eps = "" if r["eps"] is None else f"{r['eps']:g}"
    if r.get("note"):
        return [r["row"], eps, r["note"] + " |" * (len(supports) + 7) + " 0"]
    fallbacks = "" if r.get("n_fallbacks") is None else f"{_pct(r.get('fallback_specific_rate'))} ({r['n_fallbacks']})"
    return [r["row"], eps, *(_pct(r["shared_accuracy"].get(str(s))) for s in supports), _pct(r["secret_leak_rate"]),
            _pct(r["public_accuracy"]), _pair(r.get("wrong_release_rate")), _pair(r.get("fragment_rate")),
            _pct(r.get("unsupported_specific_rate")), _pct(r.get("fallback_unmarked_rate")), fallbacks,
            f"{r['seconds_per_answer']:.3f}", str(r["n_questions"])]


def _budget(b: dict) -> list[str]:
    if b.get("mode") == "aggregate":
        return ["(per query, unit one document)", f"{b['per_query']['worst_case']['epsilon']:g}", "-", "-"]
    if b.get("mode") == "fact_sheet":
        return ["(once per collection, unit one document)", f"{b['release']['epsilon']:g}", "-", "-"]
    spent = (b.get("spent") or {}).get("epsilon")
    logit = b.get("logit_bound") or []
    return [str(b.get("context_tokens", "")), "" if spent is None else f"{spent:g}",
            _span(b.get("kernel_error") or []), f"{max(logit):.3g}" if logit else ""]


def _examples(data: dict) -> list[str]:
    """Per row with receipts, the first reply of each release class and one adding a specific."""
    rows = []
    for r in (r for r in data["rows"] if r.get("releases")):
        answers = [a for a in data.get("sample_answers", []) if a["row"] == r["row"] and a["eps"] == r["eps"]]
        picks = [(c, next((a for a in answers if a.get("release") == c), None)) for c in RELEASE_CLASSES]
        picks.append(("adds a specific", next((a for a in answers if a.get("unsupported")), None)))
        rows += [[r["row"], f"{r['eps']:g}", "nothing released" if c == "none" else c, _cell(a.get("question", "")),
                  _cell(a.get("fact") or ""), _cell(a["text"]), ", ".join(a.get("unsupported") or [])]
                 for c, a in picks if a is not None]
    if not rows:
        return []
    return ["", "Example replies (the first of each kind in the result file's `sample_answers`):", "",
            table(["row", "eps", "kind", "question", "released", "reply", "unsupported specifics"], rows)]


def _span(values: Sequence[float | None]) -> str:
    """min-max of per-layer values; a None (no guarantee: out of the Taylor regime) shows as such."""
    known = [v for v in values if v is not None]
    none = len(values) - len(known)
    span = f"{min(known):.3g}-{max(known):.3g}" if known else ""
    return span + (f"{'; ' if span else ''}unbounded in {none} of {len(values)} layers" if none else "")


def _pct(x: float | None) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def plot(data: dict, path: Path) -> None:
    """Shared-fact, public accuracy and leak rate vs eps: a curve per private row, a line per other row."""
    plt = pyplot()

    def shared(r):
        n = data["question_counts_by_support"]
        total = sum(n.get(k, 0) for k in r["shared_accuracy"])
        return sum(v * n.get(k, 0) for k, v in r["shared_accuracy"].items()) / total if total else float("nan")

    panels = (("shared-fact accuracy (all supports)", shared), ("public accuracy", lambda r: r["public_accuracy"]),
              ("secret leak rate", lambda r: r["secret_leak_rate"]))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    rows = [r for r in data["rows"] if not r.get("note")]  # rows that ran
    private = [n for n in dict.fromkeys(r["row"] for r in rows) if ROWS.get(n) and ROWS[n].private]
    for ax, (title, value) in zip(axes, panels, strict=True):
        for i, r in enumerate(r for r in rows if r["eps"] is None):
            ax.axhline(value(r), color=f"C{7 + i}", ls="--", lw=1, label=r["row"])
        for i, name in enumerate(private):
            pts = sorted((r["eps"], value(r)) for r in rows if r["row"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}", label=name)
        ax.set(xscale="log", xlabel="eps (whole model, per context; 1e7: kernel error alone)", ylim=(-0.03, 1.03))
        if not private:
            ax.set_xlim(0.5, 3 * KERNEL_ONLY_EPS)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"vllm-dp bench context: {Path(data['model']).name}, {data['device']}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
