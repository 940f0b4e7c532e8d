"""A document collection's fact sheet: the facts many documents state, released once.

Each document alone yields its fact keys, a deterministic function of its own text (no model, so
nothing made up and nothing to span-check: every key's words are the document's):

1. each sentence is one fact line (a leading label such as "Memo:" is dropped); commas, colons, semicolons and brackets split it into clauses
   (a phrase never spans them: "From its headquarters in Proudrainhaven, Bromsork Robotics ...");
2. the line's words that are not very common (``answer.STOP_ZIPF``, public frequencies) may
   form the key; a word holding a digit ranks ``answer.NUMBER_BONUS`` rarer (a number is a value:
   "2718", not the rarer-looking "headcount", states how many);
3. the key is the line's two rarest phrases, each grown around its rarest word as answer-level
   aggregation's key is (``answer.run_at``: rare neighbours, a number on each side), and also
   over neighbouring capitalised words and numbers (a name: "Skeltmind River", "Pekrok
   Logistics", "September 14"); at most one of the two holds a number; in canonical order: what the sentence relates ("pekrok logistics | skeltmind river",
   "2718 | pekrok logistics"). Paraphrases of one fact share it ("The Skeltmind River runs beside
   Pekrok Logistics' main office", "Pekrok Logistics' main office overlooks the Skeltmind River").
4. a document gives at most ``limit`` distinct keys (its first), so one document moves at most
   ``limit`` keys' counts by one each: the set union's ``l0``.

``release_sheet`` is the DP set union over the documents' keys (``ThresholdRelease`` with
``l0 = limit``: discrete Laplace noise on every key's count, keys under the threshold dropped,
noise keyed so that a restart reproduces the sheet): add/remove of one document changes the
released sheet's law by at most its (epsilon, delta). A key only one document gives is released
with probability at most delta.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..privacy.partition_selection import ThresholdRelease
from .answer import (
    ORDINAL,
    SENTENCE,
    STOP_ZIPF,
    THOUSANDS,
    WORD,
    has_digit,
    rarity,
    run_at,
    words,
    zipf,
)

LABEL = re.compile(r"^\s*[^\W\d_][\w' -]{0,40}:\s+")  # "Memo: ", "Email to drivers: " (at most a few words)
CLAUSE = re.compile(r"[,;:()\[\]]")
PHRASES = 2  # phrases per key
SEPARATOR = " | "
SHEET_HEADER = "Facts that many of the documents state (each line: names the documents state together):"


def sentence_key(sentence: str) -> str | None:
    """The key of one fact line: its ``PHRASES`` rarest phrases in sorted order, or None when it
    has fewer."""
    found: list[str | None] = []
    capital: list[bool] = []
    for clause in CLAUSE.split(ORDINAL.sub("", THOUSANDS.sub("", unicodedata.normalize("NFKC", sentence)))):
        raw = WORD.findall(clause)
        found += [w.casefold() if zipf(w.casefold()) < STOP_ZIPF else None for w in raw] + [None]
        capital += [w[:1].isupper() for w in raw] + [False]

    def name(i: int, inner: int) -> bool:  # "Skeltmind River", "September 14"
        return (capital[i] or found[i].isdigit()) and capital[inner] or capital[i] and found[inner].isdigit()

    order = sorted((rarity(w), -len(w), w, i)
                   for i, w in enumerate(found) if w is not None)
    phrases: list[str] = []
    used: set[str] = set()
    for *_, word, at in order:
        if word in used or (has_digit(word) and any(map(has_digit, used))):
            continue  # at most one number: a key relates a value and a name, not two numbers
        start, end = run_at(found, at, name)
        run = [w for w in dict.fromkeys(found[start:end]) if w not in used]
        used.update(found[start:end])
        phrases.append(" ".join(run))
        if len(phrases) == PHRASES:
            return SEPARATOR.join(sorted(phrases))
    return None


def fact_keys(document: str, limit: int) -> list[str]:
    """The document's distinct sentence keys in order, at most ``limit`` of them (a leading
    label, "Memo:", "Email to drivers:", is no fact)."""
    keys: list[str] = []
    for sentence in SENTENCE.split(LABEL.sub("", document, count=1)):
        key = sentence_key(sentence)
        if key is not None and key not in keys:
            keys.append(key)
            if len(keys) == limit:
                break
    return keys


def fact_line(key: str) -> str:
    """A key as the sheet shows it: "Pekrok Logistics — 2718" (names capitalised, numbers last)."""
    phrases = sorted(key.split(SEPARATOR), key=lambda p: (p[:1].isdigit(), p))
    return " — ".join(" ".join(w.capitalize() if w.isalpha() else w for w in p.split()) for p in phrases)


@dataclass(frozen=True)
class FactSheet:
    """A released fact sheet: (key, noisy count) pairs, most stated first. Public."""

    facts: tuple[tuple[str, int], ...]

    @property
    def lines(self) -> list[str]:
        return [fact_line(key) for key, _ in self.facts]

    def system_text(self) -> str | None:
        """The plain system context serving the sheet (None: nothing released)."""
        return "\n".join([SHEET_HEADER, *(f"- {line}" for line in self.lines)]) if self.facts else None

    def about(self, question: str) -> FactSheet:
        """The facts sharing a not very common word with ``question`` (public text: a question
        about nothing on the sheet gets no sheet, and answers as without the documents)."""
        asked = {w for w in words(question) if zipf(w) < STOP_ZIPF}
        return FactSheet(tuple(f for f in self.facts if asked & set(words(f[0]))))

    def to_json(self) -> list[dict]:
        return [{"fact": fact_line(key), "key": key, "noisy_count": count} for key, count in self.facts]

    @classmethod
    def from_json(cls, facts: list[dict]) -> FactSheet:
        return cls(tuple((f["key"], f["noisy_count"]) for f in facts))


def key_counts(documents: Sequence[str], limit: int) -> Counter:
    """key -> how many documents give it (SECRET: exact counts of private data)."""
    return Counter(key for doc in documents for key in fact_keys(doc, limit))


def release_sheet(documents: Sequence[str], release: ThresholdRelease, generator: torch.Generator) -> FactSheet:
    """The DP set union of the documents' fact keys (``release.l0`` keys each at most)."""
    released = release.keyed_release(key_counts(documents, release.l0), generator)
    return FactSheet(tuple(sorted(released.items(), key=lambda kv: (-kv[1], kv[0]))))
