"""Answer-level aggregation's member-local key: what one member's answer votes for.

A member answers the question from its own documents (an ordinary greedy request: its documents
and a public extraction instruction in the system turn, then the conversation). Its vote is a
deterministic function of that answer, its own documents and public text only (the question, the
instruction), so it adds no sensitivity beyond the member's own documents:

1. the answer's first line, NFKC-normalised and case-folded, split into words (letters and
   digits);
2. words of the question and of the instruction dropped, with their forms sharing a 4-letter
   prefix (the member restating the question is no evidence: "employs" restates "employees"),
   and very common words (``STOP_ZIPF``: public word frequencies, ``wordfreq``);
3. the **span check**: only words that occur in the member's own documents are kept (a member
   whose documents do not state the fact abstains instead of voting for what the model made up);
   a word one letter or so off a word of the documents (``SPELLING``) is read as that word;
4. the **relevance check**: a word counts only where a sentence of the member's documents holds
   it together with a word of what the question asks about (its lower-case, not very common
   words: "mascot", "employees"; names, capitalised in the question, are the subject, not the
   property; words match on a 4-letter prefix, so "employs" answers "employees"): a member that
   answers with another fact of its documents abstains;
5. the key is the answer's rarest such word (lowest public frequency; ties: longer, then
   alphabetical) with the rare such words next to it (``RUN_ZIPF``) and at most one number on
   each side: "drakbre skomthu", "griquol", "2718" (not "exactly 2718"), "14 quintember",
   "september 14" (of "September 14 to 16", "September 14-16" and "September 14th"; ordinal
   suffixes are dropped).
   Members whose documents paraphrase one fact ("the Skeltmind River runs beside...", "...next
   to the Skeltmind River") answer in different words but share that run. None when no word is
   left: the member abstains.
"""

from __future__ import annotations

import difflib
import functools
import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence

WORD = re.compile(r"[^\W_]+")
STOP_ZIPF = 5.5  # words at least this frequent (Zipf scale: the, of, is, am, ...) never decide a vote
RUN_ZIPF = 3.0  # rare words next to the key's rarest one join it ("Drakbre Skomthu"), filler does not
NONE_WORDS = ("none",)  # the instruction's abstention


def words(text: str) -> list[str]:
    """The words of ``text``: NFKC, case-folded, maximal runs of letters and digits."""
    return WORD.findall(unicodedata.normalize("NFKC", text).casefold())


@functools.lru_cache(maxsize=65536)
def zipf(word: str) -> float:
    """Public English frequency of ``word`` (``wordfreq``, Zipf scale: 0 = unseen, 7 = 'the')."""
    from wordfreq import zipf_frequency

    return zipf_frequency(word, "en")


SENTENCE = re.compile(r"(?<=[.!?])\s+")
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")  # 2,718 -> 2718
ORDINAL = re.compile(r"(?<=\d)(?:st|nd|rd|th)\b")  # 14th -> 14
SPELLING = 0.85  # difflib ratio from which an answer's word is taken as a document word misspelt
PREFIX = 4  # letters two words share to count as the same property ("employs" ~ "employees")


def property_words(question: str) -> list[str]:
    """What the question asks about: its words that are not capitalised (names are its subject;
    the first word is always lower-cased) and not very common."""
    tokens = WORD.findall(unicodedata.normalize("NFKC", question))
    return [t.casefold() for i, t in enumerate(tokens) if (i == 0 or not t[:1].isupper())
            and zipf(t.casefold()) < STOP_ZIPF]


def _related(sentence: set[str], asked: Sequence[str]) -> bool:
    return any(a == b or (min(len(a), len(b)) >= PREFIX and a[:PREFIX] == b[:PREFIX]) for a in sentence for b in asked)


def candidate_words(answer: str, documents: Sequence[str], question: str, public: Iterable[str] = ()) -> list[str]:
    """The words of the answer's first line that may vote, in the answer's order (None for a
    word that may not: it breaks runs). A word may vote when it does not restate the question or
    the ``public`` texts (the instruction), is not very common, and is held by a sentence of the
    member's ``documents`` that also holds a word the question asks about."""
    lines = answer.strip().splitlines()
    first = ORDINAL.sub("", THOUSANDS.sub("", lines[0])) if lines else ""
    asked = property_words(question)
    restated = [w for text in (question, *public) for w in words(text)] + list(NONE_WORDS)
    sentences = [set(words(THOUSANDS.sub("", s))) for d in documents for s in SENTENCE.split(d)]
    relevant = set().union(*(s for s in sentences if _related(s, asked))) if sentences else set()
    own = set().union(*sentences) if sentences else set()
    spelled = [_spelled(w, own) for w in words(first)]
    return [w if w in relevant and zipf(w) < STOP_ZIPF and not _related({w}, restated) else None for w in spelled]


def _spelled(word: str, own: set[str]) -> str:
    """``word`` as the member's documents spell it: a small model copies names with a letter
    dropped ("Sundrond" for "Sundtrond"); a word of the documents this close replaces it."""
    if word in own:
        return word
    close = difflib.get_close_matches(word, own, n=1, cutoff=SPELLING)
    return close[0] if close else word


def answer_key(answer: str, documents: Sequence[str], question: str, public: Iterable[str] = ()) -> str | None:
    """The member's vote: its rarest voting word with the rare voting words next to it, or None."""
    found = candidate_words(answer, documents, question, public)
    voting = [(zipf(w), -len(w), w, i) for i, w in enumerate(found) if w is not None]
    if not voting:
        return None
    *_, at = min(voting)
    start, end = run_at(found, at)
    return " ".join(dict.fromkeys(found[start:end]))


def run_at(found: Sequence[str | None], at: int, joins: Callable[[int, int], bool] | None = None) -> tuple[int, int]:
    """``[start, end)`` of the key around ``found[at]`` (``found``: words, None where a word may
    not vote): the voting neighbours rarer than ``RUN_ZIPF`` (or that ``joins(neighbour, inner)``
    admits), then at most one number on each side."""

    def voting(i: int) -> bool:
        return 0 <= i < len(found) and found[i] is not None

    def joined(i: int, inner: int) -> bool:
        return voting(i) and (zipf(found[i]) < RUN_ZIPF or (joins is not None and joins(i, inner)))

    start, end = at, at + 1
    while joined(start - 1, start):
        start -= 1
    while joined(end, end - 1):
        end += 1
    start -= voting(start - 1) and found[start - 1].isdigit()  # one number each side: "14 quintember"
    end += voting(end) and found[end].isdigit()  # "september 14" (of "september 14 to 16", "14-16")
    return start, end
