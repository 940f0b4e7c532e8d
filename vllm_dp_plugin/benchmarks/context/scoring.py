"""Scoring of ``vllm-dp bench context``: an answer, a row's result (``ROW_KEYS``), a row that could not
run, and the recall of released fact sheets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROW_KEYS = ("row", "eps", "shared_accuracy", "secret_leak_rate", "public_accuracy",
            "seconds_per_answer", "n_questions")


@dataclass
class Answer:
    scenario: str
    kind: str
    support: int
    correct: bool
    text: str
    prompt_tokens: int


def summarize(row: str, eps: float | None, answers: Sequence[Answer], seconds: float) -> dict:
    """One result row (exactly ``ROW_KEYS``): accuracy per support of shared facts, the share of
    secrets answered (leak rate), public accuracy, wall seconds per answer."""

    def rate(xs):
        return sum(a.correct for a in xs) / len(xs) if xs else float("nan")

    shared = [a for a in answers if a.kind == "shared"]
    supports = sorted({a.support for a in shared})
    return {"row": row, "eps": eps,
            "shared_accuracy": {str(s): rate([a for a in shared if a.support == s]) for s in supports},
            "secret_leak_rate": rate([a for a in answers if a.kind == "secret"]),
            "public_accuracy": rate([a for a in answers if a.kind == "public"]),
            "seconds_per_answer": seconds / max(1, len(answers)),
            "n_questions": len(answers)}


def unfit(row: str, eps: float | None, why: str) -> dict:
    """The result row of a row that could not run (``why`` in ``note``; no answers)."""
    return {"row": row, "eps": eps, "shared_accuracy": {}, "secret_leak_rate": None, "public_accuracy": None,
            "seconds_per_answer": None, "n_questions": 0, "note": why}


def sheet_quality(scenarios: Sequence[dict], contexts: Sequence[dict]) -> dict:
    """The released sheets against the scenarios: facts per collection, and the shared facts of
    each support whose answer is on their collection's sheet (recall)."""
    facts = {c["name"]: [f["fact"].lower() for f in c.get("facts", [])] for c in contexts}
    found: dict[str, list[bool]] = {}
    for s in scenarios:
        for q in s["questions"]:
            if q["kind"] == "shared":
                hit = any(a.lower() in f for a in q["answers"] for f in facts.get(s["id"], []))
                found.setdefault(str(q["support"]), []).append(hit)
    return {"facts_per_collection": sum(len(v) for v in facts.values()) / max(1, len(facts)),
            "recall": {k: sum(v) / len(v) for k, v in sorted(found.items(), key=lambda kv: int(kv[0]))}}
