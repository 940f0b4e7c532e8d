"""A persistent, keyed record of one-shot releases: a second release of the same private data
under other noise is refused (or, when the operator allows it, counted).

A one-shot release (DP attention over a private context) is drawn once with keyed noise and
re-derived at every start. It is released again, spending its budget again, whenever what keys
the noise changes while the private data stays: another noise key, other weights, another
mechanism or bound. Two releases of one context under independent noise compose; under the same
noise over different exact states their difference leaks. The ledger remembers, per private
subject, which releases were made:

* one JSON line per release in a file (mode 0600, beside the noise key by default), appended
  under an exclusive ``flock`` so concurrent workers and restarts agree;
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

import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .accountant import Budget
from .keyed_noise import ForeignEntries, NoiseKey

LEDGER_NAME = "releases.jsonl"


class ReleaseRefused(RuntimeError):
    """The subject was already released under other noise and re-releases are not allowed."""


def default_ledger_path(key: NoiseKey) -> Path:
    """``releases.jsonl`` in the noise key's directory."""
    return key.path.parent / LEDGER_NAME


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
    """The release record at ``path`` (default: beside ``key``'s file), keyed by ``key``."""

    def __init__(self, key: NoiseKey, path: str | os.PathLike | None = None):
        self._key = key
        self.path = Path(path) if path is not None else default_ledger_path(key)
        self._key_label = key.label("ledger/key")

    def register(self, subject: str, release: str, budget: Budget, unit: str, *, allow_rerelease: bool,
                 setting: str = "attention.allow_rerelease") -> History:
        """Record release ``release`` of ``subject`` (both secret digests) spending ``budget``.

        Idempotent for a release already recorded (a restart, another worker). A new release of
        a recorded subject raises ``ReleaseRefused`` unless ``allow_rerelease``; then it is
        appended and the history's total composes both. A file holding entries written under
        another key raises ``ForeignEntries`` unless ``allow_rerelease`` (they may record this
        subject's releases). ``setting``: the configuration key that allows it (named in errors)."""
        subject_label = self._key.label("ledger/subject", subject)
        release_label = self._key.label("ledger/release", subject, release)
        with self._locked() as handle:
            entries, foreign = self._read(handle, subject_label)
            if foreign and not allow_rerelease:
                raise ForeignEntries("release ledger", self.path, foreign, self._key,
                                     "whether a private context was already released cannot be read: serving it "
                                     "now may release it again under new noise, spending its budget again",
                                     setting)
            if any(e.release == release_label for e in entries):
                return History(tuple(entries), foreign)
            if entries and not allow_rerelease:
                raise ReleaseRefused(
                    f"this private context was already released {len(entries)} time(s) under other "
                    f"noise (ledger {self.path}): the noise key, the weights, or the release's "
                    f"parameters changed since. A new release spends the budget again; set "
                    f"`{setting}: true` to serve it anyway (the budget report then "
                    "composes every release)"
                )
            entry = LedgerEntry(self._key_label, subject_label, release_label, budget.epsilon, budget.delta,
                                unit, time.time())
            handle.seek(0, os.SEEK_END)
            handle.write(entry.to_json() + "\n")
            handle.flush()
            os.fsync(handle.fileno())
            return History((*entries, entry), foreign)

    def history(self, subject: str) -> History:
        """The recorded releases of ``subject`` (none if the ledger does not exist)."""
        if not self.path.exists():
            return History((), 0)
        with self._locked() as handle:
            entries, foreign = self._read(handle, self._key.label("ledger/subject", subject))
        return History(tuple(entries), foreign)

    def _read(self, handle, subject_label: str) -> tuple[list[LedgerEntry], int]:
        handle.seek(0)
        entries, foreign = [], 0
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                entry = LedgerEntry(**json.loads(line))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"release ledger {self.path} line {number} is corrupt: {exc}") from None
            if entry.key != self._key_label:
                foreign += 1
            elif entry.subject == subject_label:
                entries.append(entry)
        return entries, foreign

    def _locked(self):
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        handle = os.fdopen(fd, "r+", encoding="utf-8")
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        return handle  # closing the file releases the lock
