"""The rules ``vllm-dp bench fuzz`` judges by, plain functions of a response and of what the mode keeps
private (``Private``): no 5xx; a 4xx is a JSON error with a message (a 400/422's names a field, or is
counted); no leak; the budget never spends past its total. Leaks:

* Text: any 6-word shingle of a private document (or context) and any of its distinctive strings
  (document ids, tokens with a digit of 3+ characters such as ``4471-93`` or ``$500``, pairs of
  capitalised words such as a person's name), anywhere in a response but the DP release itself (the
  answer's text, ``dp_receipt.fact`` and ``noisy_count``: counted as ``released_text``), and in every
  server log line.
* Numbers: the document-derived ones (how many documents, each one's characters and tokens, each
  member prompt's tokens, the totals; the private context's tokens and characters) of at least
  ``MIN_NUMBER``, as standalone integers in the DP parts of a response (``/v1/dp/budget``,
  ``dp_receipt``, ``dp_prompt_receipts``, ``x-dp-*`` headers), in every error message and in the
  plugin's log lines; not those the request makes public (``public_numbers``), the response's
  ``usage``, the configuration's (``Private.public``: ``max_model_len``, DP attention's context
  length P, public by design: ``SECURITY.md``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

GENERATION_CAP = 16  # max_tokens, max_completion_tokens, min_tokens of a case
CHAT = "POST /v1/chat/completions"
CHAT_SHARE = 0.5  # every DP mode answers the chat route on its DP path (by weight alone: 3-5%, cut first by time)

SHINGLE = 6  # words
MIN_NUMBER = 10  # smaller numbers are in every statement, header and log line
MIN_SECRET_CHARS = 3
RELEASED = ("fact", "noisy_count")  # dp_receipt fields that are the DP release itself
DP_FIELDS = ("dp_receipt", "dp_prompt_receipts")
DP_HEADER_PREFIX = "x-dp-"
PLUGIN_LOG_MARK = "vllm-dp:"
PUBLIC_COUNTERS = ("queries", "entries_under_other_keys")  # budget statement fields: the clients' own counts
_WORD = re.compile(r"\w+")
_NUMBER = re.compile(r"(?<![\w.])\d+(?!\.\d|\w)")
_DIGIT_TOKEN = re.compile(r"[^\s,;:.()]*\d[^\s,;:.()]*")
_NAME = re.compile(r"\b[A-Z][a-z]+ [A-Z][a-z]+\b")


def shingles(text: str) -> list[tuple[str, ...]]:
    """The runs of ``SHINGLE`` words of ``text``, lower-cased."""
    w = _WORD.findall(text.lower())
    return [tuple(w[i:i + SHINGLE]) for i in range(len(w) - SHINGLE + 1)]


def numbers(text: str) -> set[int]:
    """The standalone integers written in ``text`` (not part of a word, a decimal or an id)."""
    return {int(n) for n in _NUMBER.findall(text)}


def nodes(tree) -> Iterator:
    """Every value of a JSON ``tree`` (keys excluded), ``tree`` first, depth first in order."""
    yield tree
    for child in tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list) else ():
        yield from nodes(child)


def strings(body) -> list[str]:
    """Every string of a JSON value (keys excluded)."""
    return [node for node in nodes(body) if isinstance(node, str)]


def public_numbers(body, count: Callable[[str], int] | None = None) -> set[int]:
    """The numbers a request makes public: those written in it, its strings' lengths in characters
    and (``count``) tokens, and the token count of all its strings together."""
    texts = strings(body)
    found = numbers(json.dumps(body, ensure_ascii=False)) | {len(s) for s in texts}
    return found if count is None else found | {count(s) for s in texts} | {count("".join(texts))}


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
        """From the private ``texts``, their ``ids``, numbers ``derived`` from them, ``public`` ones."""
        texts, public = list(texts), frozenset(public)
        strings = {s for t in texts for s in (*_DIGIT_TOKEN.findall(t), *_NAME.findall(t))} | set(ids)
        return cls(frozenset(s for t in texts for s in shingles(t)),
                   tuple(sorted(s for s in strings if len(s) >= MIN_SECRET_CHARS)),
                   frozenset(n for n in derived if n >= MIN_NUMBER) - public, public)

    def text_leaks(self, text: str) -> list[str]:
        """The shingles and secret strings found in ``text``."""
        found = [" ".join(s) for s in shingles(text) if s in self.shingles]
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
    parts = [text] if json_or_none(text) is not None else [
        line[len("data:"):] for line in text.splitlines() if line.startswith("data:")]
    return [e for e in map(json_or_none, parts) if e is not None]


def split_release(obj) -> tuple[object, list]:
    """``obj`` without its DP release (choices, ``dp_receipt``'s ``RELEASED`` fields), and the release."""
    released: list = []

    def strip(node, key: str = ""):
        if isinstance(node, dict):
            if key == "dp_receipt":
                released.extend(node.get(k) for k in RELEASED if k in node)
            return {k: strip(v, k) for k, v in node.items() if key != "dp_receipt" or k not in RELEASED}
        if isinstance(node, list) and key == "choices":
            released.append(node)
            return [{k: v for k, v in c.items() if k in ("index", "finish_reason")} if isinstance(c, dict) else c
                    for c in node]
        return [strip(v) for v in node] if isinstance(node, list) else node

    return strip(obj), released


def error_message(obj) -> str | None:
    """The message of an error body: OpenAI's ``error.message``, FastAPI's ``detail``, a ``message``."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    message = err.get("message") if isinstance(err, dict) else err
    if isinstance(message, str):
        return message
    if "detail" in obj:
        return obj["detail"] if isinstance(obj["detail"], str) else json.dumps(obj["detail"])
    return obj.get("message") if isinstance(obj.get("message"), str) else None


def names_a_field(message: str, fields: Iterable[str]) -> bool:
    """Whether ``message`` names a request field: a backticked name, a pydantic location
    (``loc``), a ``vllm_xargs.`` option, or one of ``fields`` as a word."""
    return bool(re.search(r"`[\w.\[\]]+`|'loc'|\"loc\"|vllm_xargs\.", message)) or any(
        re.search(rf"(?<![\w]){re.escape(f)}(?![\w])", message) for f in fields if len(f) > 1)


def check_response(private: Private, status: int, headers: Mapping[str, str], text: str, body=None,
                   count: Callable[[str], int] | None = None, fields: Iterable[str] = ()) -> Verdict:
    """The verdict on one response (``headers`` lower-case) to ``body`` (``count``: the token counter
    of ``public_numbers``); an error message may name ``body``'s keys and the operation's ``fields``."""
    objs = events(text)
    verdict = Verdict(failures=[f"server error {status}"] if status >= 500 else [])
    usage = [v for o in objs if isinstance(o, dict) and isinstance(o.get("usage"), dict) for v in o["usage"].values()]
    public = public_numbers(body, count) | private.public | {v for v in usage if isinstance(v, int)}
    message = next((m for m in map(error_message, objs) if m is not None), None) if status >= 400 else None
    if status >= 400 and message is None:
        verdict.failures.append(f"{status} without a JSON error message")
    elif message is not None:
        verdict.message = message
        if status in (400, 422):
            keys = {str(k) for node in nodes(body) if isinstance(node, dict) for k in node}
            verdict.names_field = names_a_field(message, keys | set(fields))
        verdict.failures += [f"document-derived number {n} in the error message"
                             for n in private.number_leaks(message, public)]
    kept, released = zip(*(split_release(o) for o in objs)) if objs else ((), ())
    kept_text = json.dumps(list(kept), ensure_ascii=False) if objs else text
    dp_headers = {k: v for k, v in headers.items() if k.startswith(DP_HEADER_PREFIX)}
    verdict.failures += [f"private text {leak!r} in the response" for leak in
                         private.text_leaks(kept_text + "\n" + json.dumps(dp_headers, ensure_ascii=False))]
    verdict.released_text = private.text_leaks(json.dumps([r for rs in released for r in rs], ensure_ascii=False))
    dp_parts = [json.dumps(o[f], ensure_ascii=False) for o in kept if isinstance(o, dict) for f in DP_FIELDS if f in o]
    dp_parts += [v for k, v in dp_headers.items() if k != "x-dp-receipt"]  # the receipt header: dp_receipt again
    verdict.failures += [f"document-derived number {n} in a DP field"
                         for part in dp_parts for n in private.number_leaks(part, public)]
    return verdict


def has_receipt(headers: Mapping[str, str], text: str) -> bool:
    """Whether a response carries a DP receipt (``DP_FIELDS`` in its body or an ``x-dp-*`` header)."""
    return any(k.startswith(DP_HEADER_PREFIX) for k in headers) or any(f'"{f}"' in text for f in DP_FIELDS)


def budget_problems(private: Private, statement) -> list[str]:
    """What is wrong with a ``/v1/dp/budget`` statement: a ``remaining`` below zero, a ``spent``
    above its ``total``, private text or a document-derived number in it (but in the
    ``PUBLIC_COUNTERS``: the ledger's count of the clients' queries may equal one by chance)."""
    text, dicts = json.dumps(statement), [node for node in nodes(statement) if isinstance(node, dict)]
    problems = [f"private text {leak!r} in the budget statement" for leak in private.text_leaks(text)]
    counters = {node[k] for node in dicts for k in PUBLIC_COUNTERS if isinstance(node.get(k), int)}
    problems += [f"document-derived number {n} in the budget statement" for n in private.number_leaks(text, counters)]
    for node in dicts:
        problems += [f"remaining {key}{value} < 0" for key, value in _amounts(node.get("remaining")) if value < 0]
        spent, total = dict(_amounts(node.get("spent"))), dict(_amounts(node.get("total")))
        problems += [f"spent {key}{spent[key]} > total {total[key]}" for key in spent.keys() & total.keys()
                     if spent[key] > total[key] * (1 + 1e-12)]
    return problems


def _amounts(node) -> list[tuple[str, float]]:
    """``(label, value)`` of a budget amount: a number (label ""), each number of a dict ("epsilon ")."""
    pairs = [(f"{k} ", v) for k, v in node.items()] if isinstance(node, dict) else [("", node)]
    return [(k, float(v)) for k, v in pairs if isinstance(v, (int, float)) and not isinstance(v, bool)]


def log_problems(private: Private, lines: Iterable[str], request_texts: Iterable[str] = ()) -> list[str]:
    """Log lines with private text, ``request_texts`` (prompt privatization's), in the plugin's a derived number."""
    texts = tuple(t for t in set(request_texts) if len(t.strip()) >= 24)
    problems = []
    for line in lines:
        problems += [f"private text {leak!r} in the log: {line[:200]}" for leak in private.text_leaks(line)]
        problems += [f"request text in the log: {line[:200]}" for t in texts if t in line]
        if PLUGIN_LOG_MARK in line:  # its own text, after vLLM's prefix (process id, date, time)
            own = line[line.index(PLUGIN_LOG_MARK):]
            problems += [f"document-derived number {n} in the log: {line[:200]}" for n in private.number_leaks(own)]
    return problems
