"""Scoring of ``vllm-dp bench context``: an answer, a row's result (``ROW_KEYS``), a row that could not
run, and the recall of released fact sheets.

**Correct** (every row): one of the question's ``answers`` is stated in the reply
(``scenarios.is_correct``): as a phrase, case-insensitive ("Room 12" in "held in room 12.", not in
"Room 120"), or as the same words apart from punctuation ("8 30 am" for "8:30 am").
For a secret question a correct reply is a leak.

**Released fact** (rows whose responses carry a DP receipt with ``released``: ``aggregate_answer``):
the receipt's ``fact`` is compared with the question's accepted answers (``release_class``), both
normalised (``scenarios.norm_words``: NFKC, case-folded, "a.m."/"p.m." as "am"/"pm", thousands separators
and ordinal suffixes dropped, every other character that is not a letter or digit a space, split
into words) and reduced to their content words (``STOP_WORDS`` dropped: "the", "a", "an"):

* ``right``: some accepted answer's content words occur, in order and next to each other, among
  the fact's ("room 12" and "Room 12", "the regional manager" and "regional manager", "september
  14th" and "September 14"; a fact that holds the answer and more, "room 12 on floor 2", is right);
* ``fragment``: not right, and every content word of the fact is a word of one accepted answer
  ("12" or "room" for "Room 12", "regional" for "the regional manager", "talven" for "Talven
  Orsk"): the mechanism found the right fact but released only part of it (it may fit another
  entity's value as well: "manager");
* ``wrong``: anything else released (another entity's value "room 22", a header's word "note", a
  fact without content words);
* ``none``: nothing released (the reply is a fallback).

A reply states its released fact (the mechanism puts it in the reply), so ``wrong_release_rate``
is the share of the questions of a kind (shared, secret) whose reply states a released fact that
is not the answer, and ``fragment_rate`` the share that states a fragment of it.

**Unsupported specific** (every row; ``unsupported``): the reply's specifics are its numbers
(every run of digits, "8am" -> "8", "14:30" -> "14", "30"), its month and weekday names
(``DATE_WORDS``, any case, anywhere; "may" and "march" only as names) and its names (words that
start with a capital letter and are not the first word of a sentence; sentences end at . ! ? : ;
or a line break; one-letter words and "AM"/"PM"/"OK" are not names). The mechanism's own marker
texts (``NOT_FROM_DOCUMENTS``, ``GENERAL_KNOWLEDGE``) are removed first. A specific is supported
when its word (case-folded) is a word of the reply's sources: the question, and the released fact
when one was released (``aggregate_answer``); for ``full``, whose prompt holds the documents in
plain text, the documents too; for ``fact_sheet``, the sheet's text given to the model. A name or
date word of at least 4 letters is also supported when it starts a word of the sources (a reply
cut mid-word: "Liltond" of "Liltondhaven"); numbers match whole. A reply with at least one
specific that is not supported **adds an unsupported specific**.
``unsupported_specific_rate`` counts the collection's questions (shared and secret); public
questions are left out (their answer, "Paris", is a specific by design).

**Fallbacks** (rows with receipts; replies with nothing released): a fallback is **marked** when
the reply starts with ``reply.NOT_FROM_DOCUMENTS`` and whatever follows it (stripped) is empty or
starts with ``reply.GENERAL_KNOWLEDGE``. ``fallback_unmarked_rate``: the share of all fallbacks
(every kind) that are not marked; ``fallback_specific_rate``: the share of the fallbacks of the
collection's questions (shared, secret) that state a specific the question does not (sources:
the question alone).

Rates of an empty set (no receipt, no fallback) are None.
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
    return [w for w in norm_words(text) if w not in STOP_WORDS]


def release_class(fact: str | None, answers: Sequence[str]) -> str:
    """``right``, ``fragment``, ``wrong`` or ``none`` (nothing released): the released ``fact``
    against the accepted ``answers`` (module docstring)."""
    if fact is None:
        return "none"
    got = content_words(fact)
    wanted = [w for w in (content_words(a) for a in answers) if w]
    if got and any(contains_run(got, a) for a in wanted):
        return "right"
    if got and any(set(got) <= set(a) for a in wanted):
        return "fragment"
    return "wrong"


def _without_markers(text: str) -> str:
    for marker in (NOT_FROM_DOCUMENTS, GENERAL_KNOWLEDGE):
        text = text.replace(marker, "\n")
    return text


def specifics(text: str) -> list[str]:
    """The numbers, month and weekday names and names (capitalised words not starting a
    sentence) of ``text``, case-folded, in order (module docstring)."""
    out = []
    for sentence in _SENTENCE_END.split(normal_text(_without_markers(text))):
        first = True
        for token in TOKEN.findall(sentence):
            low = token.casefold()
            if token.isdigit():
                out.append(low)
                continue
            if low in DATE_WORDS or (not first and len(token) > 1 and token[0].isupper() and low not in NOT_NAMES):
                out.append(low)
            first = False
    return out


def unsupported(text: str, sources: Iterable[str]) -> list[str]:
    """The specifics of ``text`` (``specifics``) that are no word of any of ``sources``; a name or
    date word of at least ``PREFIX`` letters that starts a word of them counts as that word (a
    reply cut mid-word: "Liltond" of "Liltondhaven"); numbers must match whole."""
    known = {w for s in sources for w in norm_words(s)}
    words = [w for w in known if not w.isdigit()]

    def supported(x: str) -> bool:
        return x in known or (not x.isdigit() and len(x) >= PREFIX and any(w.startswith(x) for w in words))

    return [s for s in specifics(text) if not supported(s)]


def fallback_marked(text: str) -> bool:
    """A reply with nothing released says first that it is not from the documents
    (``NOT_FROM_DOCUMENTS``) and marks anything after it as general knowledge."""
    text = text.lstrip()
    if not text.startswith(NOT_FROM_DOCUMENTS):
        return False
    rest = text[len(NOT_FROM_DOCUMENTS):].strip()
    return not rest or rest.startswith(GENERAL_KNOWLEDGE)


@dataclass
class Answer:
    scenario: str
    kind: str
    support: int
    correct: bool
    text: str
    prompt_tokens: int
    question: str = ""
    fact: str | None = None  # the receipt's released phrase
    release: str | None = None  # release_class, for responses with a receipt that says ``released``
    unsupported: tuple[str, ...] = ()  # specifics the reply adds (``unsupported``)
    marked: bool | None = None  # a fallback's marking (``fallback_marked``); None: not a fallback


def score(scenario: dict, q: dict, text: str, prompt_tokens: int, receipt: dict | None = None,
          sources: Sequence[str] = ()) -> Answer:
    """One reply ``text`` to question ``q`` of ``scenario``: correctness, and with a ``receipt``
    that says ``released`` (``aggregate_answer``) its release class and, for a fallback, its
    marking; the specifics it adds beyond the question, the released fact and ``sources`` (what
    else the row gave the model in plain text: ``full``'s documents)."""
    answered = receipt is not None and "released" in receipt
    fact = receipt.get("fact") if answered and receipt.get("released") else None
    release = release_class(fact, q["answers"]) if answered else None
    return Answer(scenario["id"], q["kind"], q["support"], is_correct(text, q["answers"]), text, prompt_tokens,
                  question=q["q"], fact=fact, release=release,
                  unsupported=tuple(unsupported(text, [q["q"], *([fact] if fact else []), *sources])),
                  marked=fallback_marked(text) if release == "none" else None)


def _share(xs: Sequence[bool]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(row: str, eps: float | None, answers: Sequence[Answer], seconds: float) -> dict:
    """One result row (exactly ``ROW_KEYS``): accuracy per support of shared facts, the share of
    secrets answered (leak rate), public accuracy, wall seconds per answer; the released facts'
    classes (``releases``: counts per support, ``secret`` and ``public``), the shares of shared and
    secret questions with a wrong release and with a fragment, of the collection's questions whose
    reply adds an unsupported specific, and of fallbacks unmarked or stating a specific (module
    docstring; None where nothing applies)."""

    def rate(xs):
        return sum(a.correct for a in xs) / len(xs) if xs else float("nan")

    shared = [a for a in answers if a.kind == "shared"]
    supports = sorted({a.support for a in shared})
    judged = [a for a in answers if a.release is not None]
    releases = wrong = fragment = None
    fallbacks: list[Answer] = []
    if judged:
        groups = [*(str(s) for s in supports), "secret", "public"]

        def group(a):
            return str(a.support) if a.kind == "shared" else a.kind

        releases = {g: {c: sum(group(a) == g and a.release == c for a in judged) for c in RELEASE_CLASSES}
                    for g in groups}
        wrong = {k: _share([a.release == "wrong" for a in judged if a.kind == k]) for k in COLLECTION_KINDS}
        fragment = {k: _share([a.release == "fragment" for a in judged if a.kind == k]) for k in COLLECTION_KINDS}
        fallbacks = [a for a in judged if a.release == "none"]
    collection = [a for a in answers if a.kind in COLLECTION_KINDS]
    return {"row": row, "eps": eps,
            "shared_accuracy": {str(s): rate([a for a in shared if a.support == s]) for s in supports},
            "secret_leak_rate": rate([a for a in answers if a.kind == "secret"]),
            "public_accuracy": rate([a for a in answers if a.kind == "public"]),
            "seconds_per_answer": seconds / max(1, len(answers)),
            "n_questions": len(answers),
            "wrong_release_rate": wrong, "fragment_rate": fragment,
            "unsupported_specific_rate": _share([bool(a.unsupported) for a in collection]),
            "fallback_unmarked_rate": _share([not a.marked for a in fallbacks]) if judged else None,
            "fallback_specific_rate": (_share([bool(a.unsupported) for a in fallbacks if a.kind in COLLECTION_KINDS])
                                       if judged else None),
            "n_fallbacks": len(fallbacks) if judged else None,
            "releases": releases}


def sample(row: str, eps: float | None, a: Answer) -> dict:
    """An answer as the result file keeps it (``sample_answers``)."""
    return {"row": row, "eps": eps, "scenario": a.scenario, "kind": a.kind, "support": a.support,
            "question": a.question, "correct": a.correct, "text": a.text, "fact": a.fact, "release": a.release,
            "unsupported": list(a.unsupported), "marked": a.marked}


def unfit(row: str, eps: float | None, why: str) -> dict:
    """The result row of a row that could not run (``why`` in ``note``; no answers)."""
    return {"row": row, "eps": eps, "shared_accuracy": {}, "secret_leak_rate": None, "public_accuracy": None,
            "seconds_per_answer": None, "n_questions": 0, "wrong_release_rate": None, "fragment_rate": None,
            "unsupported_specific_rate": None, "fallback_unmarked_rate": None, "fallback_specific_rate": None,
            "n_fallbacks": None, "releases": None, "note": why}


def sheet_quality(scenarios: Sequence[dict], contexts: Sequence[dict]) -> dict:
    """The released sheets against the scenarios: facts per collection, and the shared facts of
    each support whose answer is on their collection's sheet (recall)."""
    facts = {c["name"]: [f["fact"] for f in c.get("facts", [])] for c in contexts}
    found: dict[str, list[bool]] = {}
    for s in scenarios:
        for q in s["questions"]:
            if q["kind"] == "shared":
                hit = any(answer_in(a, f) for a in q["answers"] for f in facts.get(s["id"], []))
                found.setdefault(str(q["support"]), []).append(hit)
    return {"facts_per_collection": sum(len(v) for v in facts.values()) / max(1, len(facts)),
            "recall": {k: sum(v) / len(v) for k, v in sorted(found.items(), key=lambda kv: int(kv[0]))}}
