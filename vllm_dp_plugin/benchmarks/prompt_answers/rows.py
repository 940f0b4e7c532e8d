"""The result rows of ``vllm-dp bench prompt-answers``: accuracy per question kind with Wilson intervals,
tokens kept, receipts, failures and example texts."""

from __future__ import annotations

import math
from collections.abc import Sequence

from vllm_dp_plugin.benchmarks.lib.scenarios import is_correct
from vllm_dp_plugin.benchmarks.prompt_answers.privatizers import Privatized
from vllm_dp_plugin.benchmarks.prompt_answers.questions import Question

KINDS = ("public", "shared", "secret")  # report order
REPRODUCTION = ("trlap_paper", "trlap_repro")


def unchanged(original: Sequence[int], private: Sequence[int]) -> int:
    """Original question tokens kept at their position."""
    return sum(a == b for a, b in zip(original, private, strict=False))


def receipt_total(receipt: dict | None) -> tuple[float | None, float | None]:
    """(epsilon, delta) of ``receipt.prompt.total`` (the composition over the question's tokens);
    inf where the receipt states no guarantee."""
    if receipt is None:
        return None, None
    total = receipt["prompt_total"]["min"]
    return tuple(float(total[k]) for k in ("epsilon", "delta"))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def summarize(mechanism: str, eps: float | None, questions: Sequence[Question], done: Sequence[Privatized],
              answers: Sequence[str]) -> dict:
    """One row: accuracy per kind (with a 95% Wilson CI), tokens unchanged, the receipts."""
    correct = [is_correct(a, q.answers) for q, a in zip(questions, answers, strict=True)]
    row: dict = {"mechanism": mechanism, "eps": eps, "questions": len(questions)}
    for kind in KINDS:
        hits = [c for q, c in zip(questions, correct, strict=True) if q.kind == kind]
        if hits:
            row[f"{kind}_accuracy"] = sum(hits) / len(hits)
            row[f"{kind}_ci"] = wilson(sum(hits), len(hits))
            row[f"{kind}_n"] = len(hits)
    tokens = sum(len(q.user_ids) for q in questions)
    kept = sum(unchanged(q.user_ids, p.ids) for q, p in zip(questions, done, strict=True))
    row.update(tokens=tokens, kept=kept, unchanged=kept / tokens if tokens else math.nan,
               questions_unchanged=sum(tuple(p.ids) == q.user_ids for q, p in zip(questions, done, strict=True)),
               correct=[int(c) for c in correct])
    receipts = [p.receipt for p in done if p.receipt is not None]
    if receipts:
        totals = [receipt_total(r) for r in receipts]
        first = receipts[0]
        row.update(
            epsilon_token=first["epsilon_token"], delta_token=first["delta_token"], valid=first["valid"],
            statement=first["statement"],
            total_epsilon=_mean([e for e, _ in totals]), total_delta=_mean([d for _, d in totals]),
            tokens_privatized=_mean([r["tokens_privatized"] for r in receipts]),
        )
        row.update({k: v for k, v in done[0].info.items()})
    if mechanism in REPRODUCTION and eps is not None:
        row["claimed_total_epsilon"] = eps * row["tokens"] / len(questions)
    return row


def _mean(values: Sequence) -> float:
    vals = [float("inf") if v == "inf" else float(v) for v in values]
    return sum(vals) / len(vals) if vals else math.nan


def failed(mechanism: str, eps: float | None, exc: BaseException) -> dict:
    return {"mechanism": mechanism, "eps": eps, "error": f"{type(exc).__name__}: {exc}"}


def example_texts(tokenizer, questions: Sequence[Question], done: Sequence[Privatized], answers: Sequence[str],
                  picks: Sequence[int]) -> list[dict]:
    return [{"question": questions[i].key, "kind": questions[i].kind,
             "text": tokenizer.decode(list(done[i].ids)), "answer": answers[i],
             "correct": is_correct(answers[i], questions[i].answers)} for i in picks]


def example_picks(questions: Sequence[Question]) -> list[int]:
    """The first question of each kind."""
    seen: dict[str, int] = {}
    for i, q in enumerate(questions):
        seen.setdefault(q.kind, i)
    return [seen[k] for k in KINDS if k in seen]
