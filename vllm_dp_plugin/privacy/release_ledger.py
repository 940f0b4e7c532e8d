"""A persistent, keyed record of one-shot releases: a second release of the same private data
under other noise is refused (or, when the operator allows it, counted).

A one-shot release (DP attention over a private context) is drawn once with keyed noise and
re-derived at every start. It is released again, spending its budget again, whenever what keys
the noise changes while the private data stays: another noise key, other weights, another
mechanism or bound. Two releases of one context under independent noise compose; under the same
noise over different exact states their difference leaks. The ledger remembers, per private
subject, which releases were made:

* one row per release in the deployment's ledger store (``ledger_store``: a SQLite file beside
  the noise key by default, or PostgreSQL), written in one locked transaction so concurrent
  workers, replicas and restarts agree;
* every identifier in it is ``NoiseKey.label`` of a secret digest (HMAC under the deployment's
  key): the file names no text, no token ids and nothing anyone without the key can test a guess
  against;
* entries made under another key cannot be matched to a subject: that key file was lost or
  replaced, and a private context released under it would be released again under new noise as
  if for the first time, so ``register`` refuses while the file holds any (``ForeignEntries``)
  unless ``allow_rerelease`` (the operator accepts releasing again); they are counted
  (``foreign``) so that a report can say the history is incomplete.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from .accountant import Budget
from .keyed_noise import ForeignEntries, NoiseKey
from .ledger_store import (
    RELEASE_LOCK,
    LedgerStore,
    Transaction,
    count_entry,
    foreign_entries,
    open_store,
)

KIND = "release"  # the store's ledger kind (``ledger_keys``)


class ReleaseRefused(RuntimeError):
    """The subject was already released under other noise and re-releases are not allowed."""


@dataclass(frozen=True)
class LedgerEntry:
    """One recorded release: labels (keyed), its (eps, delta), its unit and when it was made."""

    key: str
    subject: str
    release: str
    epsilon: float
    delta: float
    unit: str
    time: float

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class History:
    """What the ledger knows about one subject: its releases (this one included once
    registered) and how many entries were made under other keys (unmatched)."""

    releases: tuple[LedgerEntry, ...]
    foreign: int

    @property
    def total(self) -> Budget:
        """Basic composition of every release of the subject (independent noise each)."""
        return Budget(sum(e.epsilon for e in self.releases), min(1.0, sum(e.delta for e in self.releases)))

    def to_json(self) -> dict:
        return {
            "releases_of_this_context": len(self.releases),
            "total_spent": {"epsilon": self.total.epsilon, "delta": self.total.delta},
            "first_release": min((e.time for e in self.releases), default=None),
            "entries_under_other_keys": self.foreign,
        }


class ReleaseLedger:
    """The release record in ``store`` (a ``LedgerStore``, or a location ``open_store`` opens:
    a SQLite path or a ``postgresql://`` URL), keyed by ``key``."""

    def __init__(self, key: NoiseKey, store: LedgerStore | str | os.PathLike):
        self._key = key
        self.store = store if isinstance(store, LedgerStore) else open_store(store)
        self.location = self.store.location
        self._key_label = key.label("ledger/key")

    def register(self, subject: str, release: str, budget: Budget, unit: str, *, allow_rerelease: bool,
                 setting: str = "attention.allow_rerelease") -> History:
        """Record release ``release`` of ``subject`` (both secret digests) spending ``budget``.

        Idempotent for a release already recorded (a restart, another worker). A new release of
        a recorded subject raises ``ReleaseRefused`` unless ``allow_rerelease``; then it is
        recorded and the history's total composes both. A store holding entries written under
        another key raises ``ForeignEntries`` unless ``allow_rerelease`` (they may record this
        subject's releases). ``setting``: the configuration key that allows it (named in errors)."""
        subject_label = self._key.label("ledger/subject", subject)
        release_label = self._key.label("ledger/release", subject, release)
        with self.store.transaction(write=True) as tx:
            tx.serialize(RELEASE_LOCK)  # two first releases of a subject: one wins
            foreign = foreign_entries(tx, KIND, self._key_label)
            if foreign and not allow_rerelease:
                raise ForeignEntries("release ledger", self.location, foreign, self._key,
                                     "whether a private context was already released cannot be read: serving it "
                                     "now may release it again under new noise, spending its budget again",
                                     setting)
            entries = self._entries(tx, subject_label)
            if any(e.release == release_label for e in entries):
                return History(tuple(entries), foreign)
            if entries and not allow_rerelease:
                raise ReleaseRefused(
                    f"this private context was already released {len(entries)} time(s) under other "
                    f"noise (ledger {self.location}): the noise key, the weights, or the release's "
                    f"parameters changed since. A new release spends the budget again; set "
                    f"`{setting}: true` to serve it anyway (the budget report then "
                    "composes every release)"
                )
            entry = LedgerEntry(self._key_label, subject_label, release_label, budget.epsilon, budget.delta,
                                unit, time.time())
            insert_release(tx, entry)
            return History((*entries, entry), foreign)

    def history(self, subject: str) -> History:
        """The recorded releases of ``subject``."""
        with self.store.transaction(write=False) as tx:
            foreign = foreign_entries(tx, KIND, self._key_label)
            return History(tuple(self._entries(tx, self._key.label("ledger/subject", subject))), foreign)

    def _entries(self, tx: Transaction, subject_label: str) -> list[LedgerEntry]:
        rows = tx.all("SELECT key, subject, release, epsilon, delta, unit, time FROM releases "
                      "WHERE key = ? AND subject = ? ORDER BY time, release", (self._key_label, subject_label))
        return [LedgerEntry(*row) for row in rows]


def insert_release(tx: Transaction, entry: LedgerEntry) -> None:
    """One release's row, counted under its key."""
    tx.execute("INSERT INTO releases (key, subject, release, epsilon, delta, unit, time) "
               "VALUES (?, ?, ?, ?, ?, ?, ?)", (entry.key, entry.subject, entry.release, entry.epsilon,
                                                entry.delta, entry.unit, entry.time))
    count_entry(tx, KIND, entry.key)
