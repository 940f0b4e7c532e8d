"""Answer-level aggregation's member-local key: what one member's answer votes for.

A member answers the question from its own documents (an ordinary greedy request: its documents
and a public extraction instruction in the system turn, then the conversation). Its vote is a
deterministic function of that answer, its own documents and public text only (the question, the
instruction), so it adds no sensitivity beyond the member's own documents:

1. the answer's first line, NFKC-normalised and case-folded, split into words (letters and
   digits);
2. words of the question and of the instruction dropped, with their forms sharing a 4-letter
   prefix (the member restating the question is no evidence: "employs" restates "employees";
   the question's names only as written: "west" does not restate "Westgate"), and very common
   words (``STOP_ZIPF``: public word frequencies, ``wordfreq``);
3. the **span check**: only words that occur in the member's own documents are kept (a member
   whose documents do not state the fact abstains instead of voting for what the model made up);
   a word one letter or so off a word of the documents (``SPELLING``) is read as that word;
4. the **relevance check**: a word counts only where a sentence of the member's documents holds
   it together with a word of what the question asks about (its lower-case, not very common
   words: "mascot", "employees"; words match on a 4-letter prefix, so "employs" answers
   "employees") and, when the question names its subject (its capitalised words after the first:
   "Westgate", "Seattle"), one of those names: a member that answers with another fact of its
   documents, or with the same property of another site, abstains;
5. the key is the **answer phrase** around the answer's rarest such word (lowest public
   frequency, numbers counted rarer: ``rarity``; ties: longer, then alphabetical; but where the
   answer holds the noun a "which"/"what" question asks for after a voting word, that word:
   "south entrance" of "Suppliers should bring deliveries to the south entrance"): its neighbours in the answer join while the
   phrase stays a run of words of one relevant sentence of the documents (at most
   ``MAX_PHRASE`` words) and each is a voting word ("regional manager", "drakbre skomthu"), a
   number, a unit after a number ("8 am", "two years"), a capitalised or question word just
   before a number ("level 6", "Room 12", "July 11": a label, where "employs 2,718" and
   "lasts two" are not), or the noun the question asks for, which closes it ("west entrance"
   for "Which entrance ...?", "skeltmind river" for "Which river ...?": ``answer_kind``);
   numbers and number words vote however common ("6", "two") and count as rare; after a number
   only units, numbers and capitalised words join ("lg 5566", not "lg 5566 belongs"); hedges
   ("exactly 2718"), the question's other words ("flows past") and very common words ("the")
   stay out. Ordinal suffixes and thousands separators are dropped: "september 14" (of
   "September 14 to 16", "September 14-16" and "September 14th"), "2718".
   Members whose documents paraphrase one fact answer in different words but share that phrase.
   None when no word is left: the member abstains.

``extract_key`` is the member that reads instead of answering (``answer_member: extract``): no
model; its documents' clauses that name the question's subject and hold the most of what it asks
about are each read as its answer (steps 1-5), and it votes when they agree on one phrase. A
question that names no capitalised subject ("the support team") may name it in common words, so
its clauses must hold every word of it (``SUBJECT_ZIPF``), not all but one. Also a function of its
own documents and the public question only.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

WORD = re.compile(r"[^\W_]+")
STOP_ZIPF = 5.5  # words at least this frequent (Zipf scale: the, of, is, am, ...) never decide a vote
SUBJECT_ZIPF = 5.8  # a question that names no subject may name it in words this common ("support team")
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
CLAUSE_BREAK = re.compile(r"\s+[\u2014|]\s+|:\s+")  # "Ref LOG-4068 | Policy: <fact>": a header is no fact
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")  # 2,718 -> 2718
ORDINAL = re.compile(r"(?<=\d)(?:st|nd|rd|th)\b")  # 14th -> 14
SPELLING = 0.85  # difflib ratio from which an answer's word is taken as a document word misspelt
PREFIX = 4  # letters two words share to count as the same property ("employs" ~ "employees")


def focus(question: str) -> str:
    """The question itself in what the user wrote: its last sentence or clause (split as
    ``extract_key`` splits documents) that asks ("?"), else the last one: "Quick question: When is
    ...?" asks "When is ...?", and the lead-in's words name no property of it."""
    pieces = [c for s in SENTENCE.split(question.strip()) for c in CLAUSE_BREAK.split(s) if c.strip()]
    return next((c for c in reversed(pieces) if "?" in c), pieces[-1] if pieces else question)


def property_words(question: str, cutoff: float = STOP_ZIPF, skip: Iterable[str] = ()) -> list[str]:
    """What the question asks about: its words that are not capitalised (names are its subject;
    the first word is always lower-cased), not very common and not numbers (a number alone names
    no property: "What is 9 + 8?" asks nothing of a sentence that says "8 am")."""
    tokens = WORD.findall(unicodedata.normalize("NFKC", question))
    return [t.casefold() for i, t in enumerate(tokens) if (i == 0 or not t[:1].isupper())
            and zipf(t.casefold()) < cutoff and not has_digit(t) and t.casefold() not in skip]


def _related(sentence: set[str], asked: Sequence[str]) -> bool:
    return any(a == b or (min(len(a), len(b)) >= PREFIX and a[:PREFIX] == b[:PREFIX]) for a in sentence for b in asked)


HEDGES = frozenset(("exactly", "approximately", "about", "around", "nearly", "almost", "roughly", "some", "only",
                    "just", "over", "under", "least", "most", "more", "less", "than", "up"))  # never in a phrase
UNITS = frozenset(("am", "pm", "percent", "minute", "minutes", "hour", "hours", "day", "days", "week", "weeks",
                   "month", "months", "year", "years"))  # join the number before them, however common
NUMBER_WORDS = frozenset(("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                          "twelve", "fifteen", "twenty", "thirty", "forty", "fifty", "hundred"))
MAX_PHRASE = 4  # words of a released answer phrase
NUMBER_BONUS = 3.0  # Zipf units a number counts as rarer when choosing the phrase's core


def subject_words(question: str) -> list[str]:
    """Whom the question is about: its capitalised words after the first that are not very
    common ("Westgate", "Seattle"), case-folded."""
    tokens = WORD.findall(unicodedata.normalize("NFKC", question))
    return [t.casefold() for t in tokens[1:] if t[:1].isupper() and zipf(t.casefold()) < STOP_ZIPF]


WH_DETERMINERS = ("which", "what")
AUXILIARIES = frozenset(("is", "are", "was", "were", "be", "do", "does", "did", "can", "could", "has", "have", "had",
                         "will", "would", "should", "may", "must"))  # never what a question asks about


def answer_kind(question: str) -> frozenset[str]:
    """The noun the question asks for, when it names one: the word after "which" or "what"
    ("Which entrance ...?" -> entrance, "On which day ...?" -> day), its plural included; empty
    for "Who approves ...?" or "What is ...?"."""
    found = words(question)
    return frozenset(form for wh, w in itertools.pairwise(found) if wh in WH_DETERMINERS and w not in AUXILIARIES
                     for form in (w, w + "s"))


@dataclass(frozen=True)
class Reading:
    """One member's answer read against its documents: ``spelled``, the first line's words as
    the documents spell them; ``voting``, whether each may decide a vote; ``relevant``, the word
    lists of the documents' sentences that hold what the question asks about (and its subject);
    ``restated``, whether each word restates the question or the instruction."""

    spelled: list[str]
    voting: list[bool]
    restated: list[bool]
    label: list[bool]  # capitalised in the answer, or a word of the question as written
    relevant: list[list[str]]
    kind: frozenset[str] = frozenset()  # ``answer_kind`` of the question


def read(answer: str, documents: Sequence[str], question: str, public: Iterable[str] = ()) -> Reading:
    """The answer's words and which of them may vote: not restating the question or the
    ``public`` texts (the instruction), not very common, and held by a sentence of the member's
    ``documents`` that also holds a word the question asks about and, when it names one, its
    subject."""
    lines = answer.strip().splitlines()
    first = ORDINAL.sub("", THOUSANDS.sub("", lines[0])) if lines else ""
    names = set(subject_words(focus(question)))  # restated only as written: "west" does not restate "Westgate"
    restating = [w for text in (question, *public) for w in words(text) if w not in names] + list(NONE_WORDS)
    sentences = document_sentences(documents)
    relevant = relevant_sentences(sentences, question)
    within = set().union(*relevant) if relevant else set()
    own = set().union(*sentences) if sentences else set()
    raw = WORD.findall(unicodedata.normalize("NFKC", first))
    spelled = [_spelled(t.casefold(), own) for t in raw]
    restated = [w in names or _related({w}, restating) for w in spelled]
    voting = [w in within and (zipf(w) < STOP_ZIPF or numeric(w)) and not r
              for w, r in zip(spelled, restated, strict=True)]
    asked_as_written = set(words(question))
    labels = [t[:1].isupper() or w in asked_as_written for t, w in zip(raw, spelled, strict=True)]
    return Reading(spelled, voting, restated, labels, relevant, answer_kind(focus(question)))


def document_sentences(documents: Sequence[str]) -> list[list[str]]:
    """The words of each sentence of ``documents`` (thousands separators and ordinal suffixes
    dropped, as in an answer)."""
    return [words(ORDINAL.sub("", THOUSANDS.sub("", s))) for d in documents for s in SENTENCE.split(d)]


def relevant_sentences(sentences: Sequence[list[str]], question: str) -> list[list[str]]:
    """The relevance check: the sentences that hold a word of what the question asks about and,
    when it names one, its subject."""
    asked, subject = property_words(focus(question)), set(subject_words(focus(question)))
    return [s for s in sentences if _related(set(s), asked) and (not subject or subject & set(s))]


def can_answer(documents: Sequence[str], question: str) -> bool:
    """Whether a member over ``documents`` may vote at all: without a relevant sentence every
    word of any answer fails the relevance check, so it abstains whatever the model says and need
    not run (``aggregate.answer_batch``). A function of its documents and the question only."""
    return bool(relevant_sentences(document_sentences(documents), question))


def has_digit(word: str) -> bool:
    return any(c.isdigit() for c in word)


def numeric(word: str) -> bool:
    """A word that states a quantity: it holds a digit or is a number word ("five" years)."""
    return has_digit(word) or word in NUMBER_WORDS


def is_number(word: str) -> bool:
    return word.isdigit() or word in NUMBER_WORDS


def rarity(word: str) -> float:
    """How rare a voting word is, for choosing the phrase's core (lower: rarer): its public
    frequency, numbers ``NUMBER_BONUS`` rarer (a value: "6" in "level 6", however common "6" is)."""
    return zipf(word) - NUMBER_BONUS * numeric(word)


def candidate_words(answer: str, documents: Sequence[str], question: str, public: Iterable[str] = ()) -> list[str]:
    """The words of the answer's first line that may vote, in the answer's order (None for a
    word that may not: it breaks runs); see ``read``."""
    r = read(answer, documents, question, public)
    return [w if v else None for w, v in zip(r.spelled, r.voting, strict=True)]


def _spelled(word: str, own: set[str]) -> str:
    """``word`` as the member's documents spell it: a small model copies names with a letter
    dropped ("Sundrond" for "Sundtrond"); a word of the documents this close replaces it."""
    if word in own:
        return word
    close = difflib.get_close_matches(word, own, n=1, cutoff=SPELLING)
    return close[0] if close else word


def answer_key(answer: str, documents: Sequence[str], question: str, public: Iterable[str] = ()) -> str | None:
    """The member's vote: the answer phrase around its rarest voting word (module docstring,
    step 5), or None."""
    r = read(answer, documents, question, public)
    ranked = [(rarity(w), -len(w), w, i) for i, (w, v) in enumerate(zip(r.spelled, r.voting, strict=True)) if v]
    if not ranked:
        return None
    *_, at = min(ranked)
    # "Which entrance ...?": the word before the asked-for noun is the answer ("south entrance"),
    # however rare the sentence's other words ("Suppliers should bring deliveries to the south entrance")
    at = next((i - 1 for i, w in enumerate(r.spelled) if w in r.kind and i > 0 and r.voting[i - 1]), at)
    start, end = phrase_at(r, at)
    return " ".join(r.spelled[start:end])


def phrase_at(r: Reading, at: int) -> tuple[int, int]:
    """``[start, end)`` of the answer phrase around ``r.spelled[at]``: grown one neighbour at a
    time (right first) while the neighbour may join and the phrase is a run of words of one
    relevant sentence, up to ``MAX_PHRASE`` words."""
    words_ = r.spelled

    def joins(i: int, start: int, end: int) -> bool:
        if not 0 <= i < len(words_) or words_[i] in HEDGES:
            return False
        word, before = words_[i], i < start
        number_next = before and is_number(words_[start])
        after_number = not before and is_number(words_[end - 1])
        if number_next:  # "Room 12", "September 14", not "lasts two"
            return r.label[i] and (r.voting[i] or (r.restated[i] and zipf(word) < STOP_ZIPF)) or word.isdigit()
        if after_number:  # "8 am", "two years", not "5566 belongs"
            return word in UNITS or word.isdigit() or (r.label[i] and r.voting[i])
        return r.voting[i] or word.isdigit()

    def names_it(i: int) -> bool:  # the noun the question asks for closes the phrase: "west entrance"
        return 0 <= i < len(words_) and words_[i] in r.kind

    start, end = at, at + 1
    while end - start < MAX_PHRASE:
        if names_it(end) and _in_sentence(words_[start:end + 1], r.relevant):
            end += 1
            break
        if joins(end, start, end) and _in_sentence(words_[start:end + 1], r.relevant):
            end += 1
        elif joins(start - 1, start, end) and _in_sentence(words_[start - 1:end], r.relevant):
            start -= 1
        else:
            break
    return start, end



def extract_key(documents: Sequence[str], question: str) -> str | None:
    """A member's vote read from its ``documents`` without a model: their clauses (sentences split
    at a header's "|", "—" or ": ") that name the question's subject (``subject_words``, when it
    names one) and hold the most of what it asks about (``property_words``, matched as in the
    relevance check; at least one, and all but one of them; with no subject named, every word of
    the question less common than ``SUBJECT_ZIPF`` but the kind it asks for), each read as the member's answer
    (``answer_key``); the key when they agree on one, else None (abstain: a document that states
    two values for what is asked answers nothing). Every clause is read (no early exit)."""
    question = focus(question)  # the vote is a function of the question itself: a lead-in changes nothing
    asked, subject = property_words(question), set(subject_words(question))
    if not subject:  # "the support team": a common word may name whom it is about; every one must be there
        asked = property_words(question, SUBJECT_ZIPF, skip=answer_kind(question) | AUXILIARIES)
    best, keys = (max(1, len(asked) - 1) if subject else len(asked)), []
    for document in documents:
        for sentence in SENTENCE.split(document):
            for clause in CLAUSE_BREAK.split(sentence):
                held = set(words(clause))
                matched = sum(_related(held, [a]) for a in asked)
                key = answer_key(clause, (document,), question)
                if key is None or matched < best or (subject and not subject & held):
                    continue
                keys = [] if matched > best else keys
                best = matched
                keys.append(key)
    return keys[0] if len(set(keys)) == 1 else None


def _in_sentence(phrase: list[str], sentences: list[list[str]]) -> bool:
    """Whether ``phrase`` occurs as consecutive words of one of ``sentences``."""
    n = len(phrase)
    return any(s[i:i + n] == phrase for s in sentences for i in range(len(s) - n + 1))


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
