"""The deployment's ledger store, with the ledgers of earlier versions imported.

Earlier versions kept each ledger as a file of JSON lines (``queries.jsonl`` and
``releases.jsonl`` beside the noise key, or where ``aggregate.budget_file`` and ``ledger_file``
named them). At the first start on a store, each such file is imported whole in one write
transaction (with the digest of its bytes under ``ledger_meta``), then renamed ``*.migrated``:
nothing it recorded is lost, and a crash between the commit and the rename only repeats the
rename. Entries written under another key are imported as they are (they stay foreign). A file
that reappears with other bytes after its import (an older server still appending to it) is
refused: its new entries would be unaccounted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from .accountant import Budget
from .keyed_noise import NoiseKey
from .ledger_store import LedgerStore, Transaction, open_store
from .query_ledger import insert_reservation
from .release_ledger import LedgerEntry, insert_release

STORE_NAME = "ledger.sqlite"  # the default store, beside the noise key
QUERY_JSONL = "queries.jsonl"
RELEASE_JSONL = "releases.jsonl"
MIGRATED_SUFFIX = ".migrated"


class LedgerMigrationError(RuntimeError):
    """A JSONL ledger of an earlier version cannot be imported (corrupt, or changed after its
    import); nothing was imported."""


def open_ledger(location: str | None, key: NoiseKey, queries_jsonl: str | None = None,
                releases_jsonl: str | None = None) -> LedgerStore:
    """The store at ``location`` (default ``ledger.sqlite`` beside ``key``'s file), after
    importing the JSONL ledgers of earlier versions found at ``queries_jsonl`` and
    ``releases_jsonl`` (defaults: ``queries.jsonl`` and ``releases.jsonl`` beside the key)."""
    store = open_store(location or key.path.parent / STORE_NAME)
    import_jsonl(store, "query", Path(queries_jsonl or key.path.parent / QUERY_JSONL), "aggregate.budget_file")
    import_jsonl(store, "release", Path(releases_jsonl or key.path.parent / RELEASE_JSONL), "ledger_file")
    return store


def import_jsonl(store: LedgerStore, kind: str, path: Path, setting: str) -> int:
    """Import the JSONL ledger of ``kind`` ("query" or "release") at ``path`` into ``store`` if
    it exists and was not imported yet; rename it ``*.migrated``. Returns the entries imported.
    ``setting``: the configuration key that names the file (for errors)."""
    if not path.exists():
        return 0
    mark = f"imported:{kind}:{path.resolve()}"
    with store.transaction(write=True) as tx:  # read under the lock: two servers import it once
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # another server imported and renamed it meanwhile
            return 0
        digest = hashlib.sha256(data).hexdigest()
        found = tx.one("SELECT value FROM ledger_meta WHERE name = ?", (mark,))
        if found is not None and found[0] != digest:
            raise LedgerMigrationError(
                f"{setting}: {path} was imported into ledger {store.location} and has been written "
                "since (a server of an earlier version is still using it): stop it, then move the file's new "
                "lines into the store by hand or restore the imported file")
        count = 0
        if found is None:
            count = (_import_queries if kind == "query" else _import_releases)(tx, data, path)
            tx.execute("INSERT INTO ledger_meta (name, value) VALUES (?, ?)", (mark, digest))
    os.replace(path, path.with_name(path.name + MIGRATED_SUFFIX))
    _fsync_dir(path.parent)
    return count


@dataclass(frozen=True)
class _QueryLine:
    """One line of an earlier version's query ledger."""

    key: str
    context: str
    kind: str
    id: str
    epsilon: float
    delta: float
    total_epsilon: float
    total_delta: float
    time: float
    client: str = ""


def _import_queries(tx: Transaction, data: bytes, path: Path) -> int:
    """Reservations with their settlements, checked as the JSONL ledger read them."""
    reserved: dict[str, _QueryLine] = {}
    settled: dict[str, _QueryLine] = {}
    for number, fields in _lines(data, path, "query"):
        where = f"query ledger {path} line {number}"
        line = _query_line(fields, where)
        if line.kind == "reserve":
            if line.id in reserved:
                raise LedgerMigrationError(f"{where} repeats reservation id {line.id!r}")
            reserved[line.id] = line
            continue
        first = reserved.get(line.id)
        if first is None or (first.key, first.context, first.client) != (line.key, line.context, line.client):
            raise LedgerMigrationError(f"{where} settles reservation {line.id!r}, which is not reserved before it")
        if line.id in settled:
            raise LedgerMigrationError(f"{where} settles reservation {line.id!r} a second time")
        settled[line.id] = line
    for rid, line in reserved.items():
        done = settled.get(rid)
        insert_reservation(tx, line.key, rid, line.context, line.client, Budget(line.epsilon, line.delta),
                           Budget(line.total_epsilon, line.total_delta), line.time,
                           None if done is None else Budget(done.epsilon, done.delta),
                           None if done is None else done.time)
    return len(reserved)


def _import_releases(tx: Transaction, data: bytes, path: Path) -> int:
    entries: dict[tuple[str, str, str], LedgerEntry] = {}
    for number, fields in _lines(data, path, "release"):
        try:
            entry = LedgerEntry(**fields)
        except TypeError as exc:
            raise LedgerMigrationError(f"release ledger {path} line {number} is corrupt: {exc}") from None
        entries.setdefault((entry.key, entry.subject, entry.release), entry)
    for entry in entries.values():
        insert_release(tx, entry)
    return len(entries)


def _lines(data: bytes, path: Path, what: str):
    """(line number, JSON object) of each non-blank line; a final line without its newline that
    does not parse is a write torn by a crash (its call never returned): skipped."""
    raw_lines = data.split(b"\n")
    for number, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        try:
            fields = json.loads(raw.decode("utf-8"))
        except ValueError as exc:
            if number == len(raw_lines):  # the last line, not ended by a newline
                return
            raise LedgerMigrationError(f"{what} ledger {path} line {number} is corrupt: {exc}") from None
        if not isinstance(fields, dict):
            raise LedgerMigrationError(f"{what} ledger {path} line {number} is corrupt: not a JSON object")
        yield number, fields


def _query_line(fields: dict, where: str) -> _QueryLine:
    try:
        line = _QueryLine(**fields)
    except TypeError as exc:
        raise LedgerMigrationError(f"{where} is corrupt: {exc}") from None
    if line.kind not in ("reserve", "settle"):
        raise LedgerMigrationError(f"{where} is corrupt: unknown kind {line.kind!r}")
    for name in ("key", "context", "id", "client"):
        if not isinstance(getattr(line, name), str):
            raise LedgerMigrationError(f"{where} is corrupt: {name} is not a string")
    for name in ("epsilon", "delta", "total_epsilon", "total_delta", "time"):
        value = getattr(line, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise LedgerMigrationError(f"{where} is corrupt: {name} is not a finite number >= 0: {value!r}")
    return line


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
