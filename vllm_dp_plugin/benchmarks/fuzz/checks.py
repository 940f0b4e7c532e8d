"""The properties ``vllm-dp bench fuzz`` checks on every response, as plain functions of the
response's parts (status, headers, body text) and of what the served mode keeps private
(``Private``): no 5xx; a 4xx is a JSON error with a message (and, for 400/422, names a field);
no document text, secret string or document-derived number where a client or a log reads it;
the budget statement never spends past its total. Each returns the problems it finds (empty:
none); nothing here imports vLLM or schemathesis.

What counts as a leak, and where it is looked for:

* Text: any 6-word shingle of a private document (or context) and any of its distinctive
  strings (document ids, tokens with a digit of 3+ characters such as ``4471-93`` or ``$500``,
  pairs of capitalised words such as a person's name), anywhere in a response except the DP
  release itself (the answer's text, ``dp_receipt.fact`` and ``noisy_count``: DP outputs, counted
  apart as ``released_text``), and in every server log line.
* Numbers: the document-derived numbers (how many documents, each one's characters and tokens,
  each member prompt's tokens, the totals; the private context's tokens and characters) of at
  least ``MIN_NUMBER``, as standalone integers in the DP-specific parts of a response (the
  ``/v1/dp/budget`` statement, ``dp_receipt``, ``dp_prompt_receipts``, ``x-dp-*`` headers) and in
  every error message, and in the plugin's own log lines (``vllm-dp:``). A number the request
  itself makes public is not a leak: the numbers written in the request, its strings' lengths
  in characters and tokens (``public`` of each case), the response's ``usage`` and the
  configuration's public numbers (``Private.public``, e.g. ``max_model_len``); the private
  context's length ``P`` is public by design in DP attention (``SECURITY.md``) and goes there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

SHINGLE = 6  # words
MIN_NUMBER = 10  # smaller numbers are in every statement, header and log line
MIN_SECRET_CHARS = 3
RELEASED = ("fact", "noisy_count")  # dp_receipt fields that are the DP release itself
DP_FIELDS = ("dp_receipt", "dp_prompt_receipts")
DP_HEADER_PREFIX = "x-dp-"
PLUGIN_LOG_MARK = "vllm-dp:"
# budget statement fields counting what clients did (their queries), public
PUBLIC_COUNTERS = ("queries", "entries_under_other_keys")
_WORD = re.compile(r"\w+")
_NUMBER = re.compile(r"(?<![\w.])\d+(?!\.\d|\w)")
_DIGIT_TOKEN = re.compile(r"[^\s,;:.()]*\d[^\s,;:.()]*")
_NAME = re.compile(r"\b[A-Z][a-z]+ [A-Z][a-z]+\b")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def numbers(text: str) -> set[int]:
    """The standalone integers written in ``text`` (not part of a word, a decimal or an id)."""
    return {int(n) for n in _NUMBER.findall(text)}


@dataclass(frozen=True)
class Private:
    """What one served mode keeps private, in the form the checks search for."""

    shingles: frozenset[tuple[str, ...]] = frozenset()
    strings: tuple[str, ...] = ()
    numbers: frozenset[int] = frozenset()  # document-derived, >= MIN_NUMBER, public ones removed
    public: frozenset[int] = frozenset()  # the configuration's numbers, declared public

    @classmethod
    def of(cls, texts: Iterable[str], ids: Iterable[str] = (), derived: Iterable[int] = (),
           public: Iterable[int] = ()) -> Private:
        """From the private ``texts`` (documents or a context), their ``ids`` and the numbers
        ``derived`` from them (lengths, counts); ``public``: numbers the configuration states."""
        texts, public = list(texts), frozenset(public)
        shingles = {tuple(w[i:i + SHINGLE]) for w in map(words, texts) for i in range(len(w) - SHINGLE + 1)}
        strings = {s for t in texts for s in (*_DIGIT_TOKEN.findall(t), *_NAME.findall(t))}
        strings |= set(ids)
        return cls(frozenset(shingles), tuple(sorted(s for s in strings if len(s) >= MIN_SECRET_CHARS)),
                   frozenset(n for n in derived if n >= MIN_NUMBER) - public, public)

    def text_leaks(self, text: str) -> list[str]:
        """The shingles and secret strings found in ``text``."""
        w = words(text)
        found = [" ".join(w[i:i + SHINGLE]) for i in range(len(w) - SHINGLE + 1) if tuple(w[i:i + SHINGLE]) in self.shingles]
        found += [s for s in self.strings if re.search(rf"(?<!\w){re.escape(s)}(?!\w)", text)]
        return sorted(set(found))

    def number_leaks(self, text: str, public: Iterable[int] = ()) -> list[int]:
        """The document-derived numbers written in ``text``, less ``public`` ones."""
        return sorted((numbers(text) & self.numbers) - set(public))


@dataclass
class Verdict:
    """One response's problems (``failures``) and what is reported without failing it."""

    failures: list[str] = field(default_factory=list)
    names_field: bool | None = None  # a 400/422 whose message names a request field (None: not one)
    message: str = ""  # the error message of a 4xx/5xx
    released_text: list[str] = field(default_factory=list)  # shingles in the DP release (not a failure)


def json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def events(text: str) -> list:
    """The JSON objects of a body: itself, or each ``data:`` event of a stream."""
    whole = json_or_none(text)
    if whole is not None:
        return [whole]
    found = (json_or_none(line[len("data:"):].strip()) for line in text.splitlines() if line.startswith("data:"))
    return [e for e in found if e is not None]


def split_release(obj) -> tuple[object, list]:
    """``obj`` without its DP release (choices' text and content, ``dp_receipt``'s ``RELEASED``
    fields) and the release's values."""
    released: list = []

    def strip(node, key: str = ""):
        if isinstance(node, dict):
            if key == "dp_receipt":
                released.extend(node.get(k) for k in RELEASED if k in node)
                return {k: strip(v, k) for k, v in node.items() if k not in RELEASED}
            return {k: strip(v, k) for k, v in node.items()}
        if isinstance(node, list):
            if key == "choices":
                released.append(node)
                return [{k: v for k, v in c.items() if k in ("index", "finish_reason")} if isinstance(c, dict) else c
                        for c in node]
            return [strip(v) for v in node]
        return node

    return strip(obj), released


def error_message(obj) -> str | None:
    """The message of an error body: OpenAI's ``error.message``, FastAPI's ``detail`` or a
    top-level ``message``."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    if isinstance(err, str):
        return err
    if "detail" in obj:
        return json.dumps(obj["detail"]) if not isinstance(obj["detail"], str) else obj["detail"]
    return obj.get("message") if isinstance(obj.get("message"), str) else None


def names_a_field(message: str, fields: Iterable[str]) -> bool:
    """Whether ``message`` names a request field: a backticked name, a pydantic location
    (``loc``), a ``vllm_xargs.`` option, or one of ``fields`` (the request's keys and the
    operation's schema properties) as a word."""
    if re.search(r"`[\w.\[\]]+`|'loc'|\"loc\"|vllm_xargs\.", message):
        return True
    return any(re.search(rf"(?<![\w]){re.escape(f)}(?![\w])", message) for f in fields if len(f) > 1)


def request_fields(body) -> set[str]:
    """Every key of a JSON request body, nested ones included."""
    found: set[str] = set()
    stack = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found |= {str(k) for k in node}
            stack += node.values()
        elif isinstance(node, list):
            stack += node
    return found


def check_response(private: Private, status: int, headers: Mapping[str, str], text: str,
                   public: Iterable[int] = (), fields: Iterable[str] = ()) -> Verdict:
    """The verdict on one response (``headers`` with lower-case names; ``public``: the numbers
    the request makes public; ``fields``: the names a message may name)."""
    verdict = Verdict()
    objs = events(text)
    public = set(public) | private.public
    for obj in objs:
        usage = obj.get("usage") if isinstance(obj, dict) else None
        if isinstance(usage, dict):
            public |= {v for v in usage.values() if isinstance(v, int)}
    if status >= 500:
        verdict.failures.append(f"server error {status}")
    if status >= 400:
        message = next((m for m in map(error_message, objs) if m is not None), None)
        if message is None:
            verdict.failures.append(f"{status} without a JSON error message")
        else:
            verdict.message = message
            if status in (400, 422):
                verdict.names_field = names_a_field(message, fields)
            for n in private.number_leaks(message, public):
                verdict.failures.append(f"document-derived number {n} in the error message")
    kept, released = zip(*(split_release(o) for o in objs)) if objs else ((), ())
    kept_text = json.dumps(list(kept), ensure_ascii=False) if objs else text
    dp_headers = {k: v for k, v in headers.items() if k.startswith(DP_HEADER_PREFIX)}
    for leak in private.text_leaks(kept_text + "\n" + json.dumps(dp_headers, ensure_ascii=False)):
        verdict.failures.append(f"private text {leak!r} in the response")
    verdict.released_text = private.text_leaks(json.dumps([r for rs in released for r in rs], ensure_ascii=False))
    dp_parts = [json.dumps(o[f], ensure_ascii=False) for o in kept if isinstance(o, dict) for f in DP_FIELDS if f in o]
    dp_parts += [v for k, v in dp_headers.items() if k != "x-dp-receipt"]  # the receipt header: dp_receipt again
    for part in dp_parts:
        for n in private.number_leaks(part, public):
            verdict.failures.append(f"document-derived number {n} in a DP field")
    return verdict


def budget_problems(private: Private, statement) -> list[str]:
    """What is wrong with a ``/v1/dp/budget`` statement: a ``remaining`` below zero, a ``spent``
    above its ``total``, private text or a document-derived number in it (but in the
    ``PUBLIC_COUNTERS``: the ledger's count of the clients' queries may equal one by chance)."""
    problems = [f"private text {leak!r} in the budget statement" for leak in private.text_leaks(json.dumps(statement))]
    counters = {node[k] for node in _dicts(statement) for k in PUBLIC_COUNTERS if isinstance(node.get(k), int)}
    problems += [f"document-derived number {n} in the budget statement"
                 for n in private.number_leaks(json.dumps(statement), counters)]
    for node in _dicts(statement):
        for key, value in _amounts(node.get("remaining")):
            if value < 0:
                problems.append(f"remaining {key}{value} < 0")
        spent, total = dict(_amounts(node.get("spent"))), dict(_amounts(node.get("total")))
        for key in spent.keys() & total.keys():
            if spent[key] > total[key] * (1 + 1e-12):
                problems.append(f"spent {key}{spent[key]} > total {total[key]}")
    return problems


def _dicts(node) -> Iterator[dict]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _dicts(v)
    elif isinstance(node, list):
        for v in node:
            yield from _dicts(v)


def _amounts(node) -> list[tuple[str, float]]:
    """``(label, value)`` of a budget amount: a number (label ""), or a dict of numbers
    (epsilon, delta: label "epsilon ")."""
    if isinstance(node, bool):
        return []
    if isinstance(node, (int, float)):
        return [("", float(node))]
    if isinstance(node, dict):
        return [(f"{k} ", float(v)) for k, v in node.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return []


def log_problems(private: Private, lines: Iterable[str], request_texts: Iterable[str] = ()) -> list[str]:
    """Server log lines holding private text or a request's text (``request_texts``: strings
    a client sent, private in prompt privatization), or, in the plugin's own lines, a
    document-derived number."""
    texts = tuple(t for t in set(request_texts) if len(t.strip()) >= 24)
    problems = []
    for line in lines:
        problems += [f"private text {leak!r} in the log: {line[:200]}" for leak in private.text_leaks(line)]
        problems += [f"request text in the log: {line[:200]}" for t in texts if t in line]
        if PLUGIN_LOG_MARK in line:  # its own text, after vLLM's prefix (process id, date, time)
            own = line[line.index(PLUGIN_LOG_MARK):]
            problems += [f"document-derived number {n} in the log: {line[:200]}" for n in private.number_leaks(own)]
    return problems
