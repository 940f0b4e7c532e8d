"""A private document collection: one document = one privacy unit.

Sources: a JSONL file (one JSON object per line with ``id`` and ``text``) or a directory (each
``*.txt`` file is one document, its stem the id). Every document needs its own unique id: the id
decides its member, so it must not depend on the other documents (a line number would: removing
one line would renumber, and re-assign, every later document). A document longer than the public cap ``max_document_tokens`` is refused
(split it yourself: the unit is then each part). Documents are partitioned into ``k`` members by
a keyed hash of their id (public and data-independent: the assignment depends on the id and the
deployment's key, never on the text), so one document lands in exactly one member.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..privacy.validation import check_count


@dataclass(frozen=True)
class Document:
    id: str
    text: str


@dataclass(frozen=True)
class Collection:
    """A named collection's documents, in source order."""

    name: str
    documents: tuple[Document, ...]

    def partition(self, members: int, digest: Callable[[str], bytes]) -> tuple[tuple[Document, ...], ...]:
        """``members`` disjoint parts: document d goes to member ``digest(d.id) mod members``
        (``digest``: a keyed hash; the order inside a member is the source order)."""
        check_count(members, "members")
        parts: list[list[Document]] = [[] for _ in range(members)]
        for doc in self.documents:
            parts[int.from_bytes(digest(doc.id)[:8], "big") % members].append(doc)
        return tuple(tuple(p) for p in parts)


def load_collection(name: str, path: str | Path, count_tokens: Callable[[str], int] | None = None,
                    max_document_tokens: int | None = None, where: str = "aggregate.contexts") -> Collection:
    """The documents at ``path`` (JSONL file or directory of ``*.txt``); ``ValueError`` naming
    ``where`` for an unreadable source, a duplicate id, an empty collection, or a document over
    ``max_document_tokens`` (counted with ``count_tokens``)."""
    path = Path(path)
    key = f"{where}.{name}"
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        docs = [Document(p.stem, p.read_text(encoding="utf-8")) for p in files]
    elif path.is_file():
        docs = _jsonl(path, key)
    else:
        raise ValueError(f"{key}: {path} is neither a JSONL file nor a directory")
    if not docs:
        raise ValueError(f"{key}: {path} holds no documents")
    seen: set[str] = set()
    for doc in docs:
        if doc.id in seen:
            raise ValueError(f"{key}: document id {doc.id!r} appears twice in {path}")
        seen.add(doc.id)
        if count_tokens is not None and max_document_tokens is not None:
            n = count_tokens(doc.text)
            if n > max_document_tokens:  # the id is the operator's own label, not private text
                raise ValueError(f"{key}: document {doc.id!r} has {n} tokens, more than "
                                 f"max_document_tokens={max_document_tokens}; split it (each part is then "
                                 "one unit) or raise the cap")
    return Collection(name, tuple(docs))


def _jsonl(path: Path, key: str) -> list[Document]:
    docs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{key}: {path} line {number} is not JSON: {exc}") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ValueError(f"{key}: {path} line {number} needs a string field `text`")  # noqa: TRY004
        doc_id = row.get("id")
        if isinstance(doc_id, bool) or not isinstance(doc_id, str | int) or doc_id == "":
            raise ValueError(f"{key}: {path} line {number} needs an `id` (a non-empty string or an integer): "
                             "the id decides the document's member, and a line number would move every later "
                             "document when one line is removed")
        docs.append(Document(str(doc_id), row["text"]))
    return docs


def member_texts(parts: Sequence[Sequence[Document]], separator: str = "\n") -> list[str]:
    """Each member's documents joined by ``separator`` (its system prompt)."""
    return [separator.join(d.text for d in part) for part in parts]
