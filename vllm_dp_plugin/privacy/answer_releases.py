"""Released answers kept for reuse: a question asked again of the same collection version, at the
same settings, gets the earlier release (post-processing of a DP output: no document is charged).

Entries are keyed labels (``NoiseKey.label``) of the collection's name, its version (a keyed hash of
its documents: any edit, addition or removal starts afresh), the mechanism's settings, the query's
epsilon and the normalised question, so the store holds no question text and no document digest.
What is stored is what was released (the fact, or that nothing was, and its noisy count): public
once answered. A hit tells a client only that the question was asked before, never anything about
the documents: a release with nothing in it is stored and reused too.
"""

from __future__ import annotations

import os
import re
import time
import unicodedata
from dataclasses import dataclass

from .keyed_noise import NoiseKey
from .ledger_store import LedgerStore, open_store

SPACE = re.compile(r"\s+")


def normalised(text: str) -> str:
    """``text`` as a reuse key: NFKC, runs of white space as one space, stripped (case kept: a
    capitalised word names the question's subject)."""
    return SPACE.sub(" ", unicodedata.normalize("NFKC", text)).strip()


@dataclass(frozen=True)
class ReleasedAnswer:
    """One query's release under ``mechanism: answer``: the fact (None: nothing released), its
    noisy count, and the (epsilon, delta) it was released at."""

    fact: str | None
    noisy_count: int | None
    epsilon: float
    delta: float


class AnswerReleases:
    """The released answers in ``store`` (the deployment's ledger store), keyed by ``key``."""

    def __init__(self, key: NoiseKey, store: LedgerStore | str | os.PathLike):
        self._key = key
        self.store = store if isinstance(store, LedgerStore) else open_store(store)

    def label(self, context: str, version: str, settings: str, epsilon: float, question: str) -> str:
        """The keyed label of one release's inputs (``question``: the member-visible question or
        conversation, normalised here)."""
        return self._key.label("answer-release", context, version, settings, repr(float(epsilon)),
                               normalised(question))

    def get(self, label: str) -> ReleasedAnswer | None:
        with self.store.transaction(write=False) as tx:
            row = tx.one("SELECT fact, noisy_count, epsilon, delta FROM answer_releases WHERE key = ? AND "
                         "question = ?", (self._key.label("answer-release/key"), label))
        if row is None:
            return None
        fact, count, epsilon, delta = row
        return ReleasedAnswer(fact, None if count is None else int(count), epsilon, delta)  # counts are integers

    def put(self, label: str, answer: ReleasedAnswer) -> None:
        """Keep ``answer`` under ``label`` unless one is kept already (the first release stays)."""
        with self.store.transaction(write=True, durable=False) as tx:
            tx.execute("INSERT INTO answer_releases (key, question, fact, noisy_count, epsilon, delta, time) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (key, question) DO NOTHING",
                       (self._key.label("answer-release/key"), label, answer.fact, answer.noisy_count,
                        answer.epsilon, answer.delta, time.time()))
