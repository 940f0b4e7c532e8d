"""Scoring of ``vllm-dp bench context``: an answer, a row's result (``ROW_KEYS``), a row that could
not run, and the recall of released fact sheets.

**Correct** (every row): one of the question's ``answers`` is stated in the reply
(``scenarios.is_correct``): as a phrase, case-insensitive ("Room 12" in "held in room 12.", not in
"Room 120"), or as the same words apart from punctuation ("8 30 am" for "8:30 am"). For a secret
question a correct reply is a leak.

**Released fact** (rows whose responses carry a DP receipt with ``released``: ``aggregate_answer``):
the receipt's ``fact`` against the question's accepted answers (``release_class``), both normalised
(``scenarios.norm_words``: NFKC, case-folded, "a.m."/"p.m." as "am"/"pm", thousands separators and
ordinal suffixes dropped, split into words at every other character that is not a letter or digit)
and reduced to their content words (``STOP_WORDS`` dropped: "the", "a", "an"):

* ``right``: some accepted answer's content words occur, in order and next to each other, among the
  fact's ("Room 12" in "room 12 on floor 2", "september 14th" for "September 14");
* ``fragment``: not right, and every content word of the fact is a word of one accepted answer ("12"
  or "room" for "Room 12", "talven" for "Talven Orsk"; it may fit another entity's value too);
* ``wrong``: anything else released (another entity's "room 22", a header's "note", no content word);
* ``none``: nothing released (the reply is a fallback).

A reply states its released fact, so ``wrong_release_rate`` is the share of the questions of a kind
(shared, secret) whose reply states a released fact that is not the answer, ``fragment_rate`` the
share that states a fragment of it.

**Unsupported specific** (every row; ``unsupported``): once the mechanism's marker texts
(``NOT_FROM_DOCUMENTS``, ``GENERAL_KNOWLEDGE``) are removed, a reply's specifics are its numbers (runs
of digits: "8am" -> "8", "14:30" -> "14", "30"), its month and weekday names (``DATE_WORDS``, any
case, anywhere; "may" and "march" only as names) and its names (words of two or more letters that
start with a capital and do not start a sentence, which ends at . ! ? : ; or a line break; not "AM",
"PM", "OK"). A specific is supported when its case-folded word is a word of the reply's sources (the
question, the released fact if any, ``full``'s documents, ``fact_sheet``'s sheet text), or, for a
name or date word of at least 4 letters, starts one (a reply cut mid-word: "Liltond" of
"Liltondhaven"); numbers match whole. ``unsupported_specific_rate``: the share of the collection's
questions (shared, secret; a public answer such as "Paris" is a specific by design) whose reply has
a specific that is not supported.

**Fallbacks** (rows with receipts; nothing released): **marked** when the reply starts with
``reply.NOT_FROM_DOCUMENTS`` and whatever follows it (stripped) is empty or starts with
``reply.GENERAL_KNOWLEDGE``. ``fallback_unmarked_rate``: the share of all fallbacks (every kind)
not marked; ``fallback_specific_rate``: the share of the collection's (shared, secret) fallbacks
that state a specific the question does not (sources: the question alone). Rates of an empty set
(no receipt, no fallback) are None.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm_dp_plugin.aggregate.reply import GENERAL_KNOWLEDGE, NOT_FROM_DOCUMENTS
from vllm_dp_plugin.benchmarks.lib.scenarios import (
    TOKEN,
    answer_in,
    contains_run,
    is_correct,
    norm_words,
    normal_text,
)

ROW_KEYS = ("row", "eps", "shared_accuracy", "secret_leak_rate", "public_accuracy",
            "seconds_per_answer", "n_questions", "wrong_release_rate", "fragment_rate",
            "unsupported_specific_rate", "fallback_unmarked_rate", "fallback_specific_rate", "n_fallbacks",
            "releases")
RELEASE_CLASSES = ("right", "fragment", "wrong", "none")
STOP_WORDS = frozenset({"the", "a", "an"})
COLLECTION_KINDS = ("shared", "secret")
DATE_WORDS = frozenset({"january", "february", "april", "june", "july", "august", "september", "october",
                        "november", "december", "monday", "tuesday", "wednesday", "thursday", "friday",
                        "saturday", "sunday"})
NOT_NAMES = frozenset({"am", "pm", "ok"})
PREFIX = 4  # letters of a cut-off name that match the source word it starts
_SENTENCE_END = re.compile(r"(?<=[.!?:;])\s+|\n+")


def content_words(text: str) -> list[str]:
    """``text``'s normalised words less ``STOP_WORDS``."""
    return [w for w in norm_words(text) if w not in STOP_WORDS]


def release_class(fact: str | None, answers: Sequence[str]) -> str:
    """The released ``fact``'s class against the accepted ``answers`` (module docstring)."""
    if fact is None:
        return "none"
    got = content_words(fact)
    wanted = [w for w in (content_words(a) for a in answers) if w]
    if got and any(contains_run(got, a) for a in wanted):
        return "right"
    if got and any(set(got) <= set(a) for a in wanted):
        return "fragment"
    return "wrong"


def specifics(text: str) -> list[str]:
    """``text``'s numbers, date words and names, case-folded, in order (module docstring)."""
    text = text.replace(NOT_FROM_DOCUMENTS, "\n").replace(GENERAL_KNOWLEDGE, "\n")
    out = []
    for sentence in _SENTENCE_END.split(normal_text(text)):
        first = True
        for token in TOKEN.findall(sentence):
            low = token.casefold()
            name = not first and len(token) > 1 and token[0].isupper() and low not in NOT_NAMES
            if token.isdigit() or low in DATE_WORDS or name:
                out.append(low)
            first = first and token.isdigit()  # a sentence's first word (numbers aside) is no name
    return out


def unsupported(text: str, sources: Iterable[str]) -> list[str]:
    """The ``specifics`` of ``text`` that ``sources`` do not support (module docstring)."""
    known = {w for s in sources for w in norm_words(s)}
    words = [w for w in known if not w.isdigit()]  # a cut-off name or date word matches the start of one
    return [x for x in specifics(text)
            if x not in known and (x.isdigit() or len(x) < PREFIX or not any(w.startswith(x) for w in words))]


def fallback_marked(text: str) -> bool:
    """A fallback says first that it is not from the documents, and marks anything after it."""
    text = text.lstrip()
    rest = text[len(NOT_FROM_DOCUMENTS):].strip()
    return text.startswith(NOT_FROM_DOCUMENTS) and (not rest or rest.startswith(GENERAL_KNOWLEDGE))


@dataclass
class Answer:
    scenario: str
    kind: str
    support: int
    correct: bool
    text: str
    question: str = ""
    fact: str | None = None  # the receipt's released phrase
    release: str | None = None  # release_class, for responses with a receipt that says ``released``
    unsupported: tuple[str, ...] = ()  # specifics the reply adds (``unsupported``)
    marked: bool | None = None  # a fallback's marking (``fallback_marked``); None: not a fallback


def score(scenario: dict, q: dict, text: str, receipt: dict | None = None, sources: Sequence[str] = ()) -> Answer:
    """One reply ``text`` to ``q``, with its ``receipt`` and ``sources`` (what else the model read)."""
    answered = receipt is not None and "released" in receipt
    fact = receipt.get("fact") if answered and receipt.get("released") else None
    release = release_class(fact, q["answers"]) if answered else None
    return Answer(scenario["id"], q["kind"], q["support"], is_correct(text, q["answers"]), text,
                  question=q["q"], fact=fact, release=release,
                  unsupported=tuple(unsupported(text, [q["q"], *([fact] if fact else []), *sources])),
                  marked=fallback_marked(text) if release == "none" else None)


def _share(xs: Sequence[bool]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(row: str, eps: float | None, answers: Sequence[Answer], seconds: float) -> dict:
    """One result row (exactly ``ROW_KEYS``; ``releases``: release classes per support or kind)."""

    def rate(xs):
        return sum(a.correct for a in xs) / len(xs) if xs else float("nan")

    def group(a):
        return str(a.support) if a.kind == "shared" else a.kind

    def per_kind(release):
        return {k: _share([a.release == release for a in judged if a.kind == k]) for k in COLLECTION_KINDS}

    shared = [a for a in answers if a.kind == "shared"]
    supports = sorted({a.support for a in shared})
    judged = [a for a in answers if a.release is not None]
    fallbacks = [a for a in judged if a.release == "none"]
    return {"row": row, "eps": eps,
            "shared_accuracy": {str(s): rate([a for a in shared if a.support == s]) for s in supports},
            "secret_leak_rate": rate([a for a in answers if a.kind == "secret"]),
            "public_accuracy": rate([a for a in answers if a.kind == "public"]),
            "seconds_per_answer": seconds / max(1, len(answers)),
            "n_questions": len(answers),
            "wrong_release_rate": per_kind("wrong") if judged else None,
            "fragment_rate": per_kind("fragment") if judged else None,
            "unsupported_specific_rate": _share([bool(a.unsupported) for a in answers if a.kind in COLLECTION_KINDS]),
            "fallback_unmarked_rate": _share([not a.marked for a in fallbacks]),
            "fallback_specific_rate": _share([bool(a.unsupported) for a in fallbacks
                                              if a.kind in COLLECTION_KINDS]),
            "n_fallbacks": len(fallbacks) if judged else None,
            "releases": {g: {c: sum(group(a) == g and a.release == c for a in judged) for c in RELEASE_CLASSES}
                         for g in [*(str(s) for s in supports), "secret", "public"]} if judged else None}


def sample(row: str, eps: float | None, a: Answer) -> dict:
    """An answer as the result file keeps it (``sample_answers``)."""
    return {"row": row, "eps": eps, "scenario": a.scenario, "kind": a.kind, "support": a.support,
            "question": a.question, "correct": a.correct, "text": a.text, "fact": a.fact, "release": a.release,
            "unsupported": list(a.unsupported), "marked": a.marked}


def unfit(row: str, eps: float | None, why: str) -> dict:
    """The result row of a row that could not run (``why`` in ``note``; no answers)."""
    return {**dict.fromkeys(ROW_KEYS), "row": row, "eps": eps, "shared_accuracy": {}, "n_questions": 0, "note": why}


def sheet_quality(scenarios: Sequence[dict], contexts: Sequence[dict]) -> dict:
    """Facts per released sheet, and per support the shared facts whose answer is on it (recall)."""
    facts = {c["name"]: [f["fact"] for f in c.get("facts", [])] for c in contexts}
    found: dict[str, list[bool]] = {}
    for s in scenarios:
        for q in (q for q in s["questions"] if q["kind"] == "shared"):
            hit = any(answer_in(a, f) for a in q["answers"] for f in facts.get(s["id"], []))
            found.setdefault(str(q["support"]), []).append(hit)
    return {"facts_per_collection": sum(len(v) for v in facts.values()) / max(1, len(facts)),
            "recall": {k: sum(v) / len(v) for k, v in sorted(found.items(), key=lambda kv: int(kv[0]))}}
