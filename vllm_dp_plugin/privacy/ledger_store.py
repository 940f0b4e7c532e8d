"""Where the budget ledgers live: a SQLite database (the embedded default) or a PostgreSQL server
that several API servers or machines share (``ledger: postgresql://...``).

One schema in both (``SCHEMA``): the query ledger's reservations and its running totals per
(key, context, client), the per-document ledger's spending per (key, context, client, document)
and its reservations, the answers released for reuse, the release ledger's releases, and per (kind, key) how many entries each
noise key wrote (a lost key shows as entries under another key without a scan). Every call is
one transaction that takes the write lock first (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL: the
rows it reads ``FOR UPDATE``), so processes sharing a store never both grant the last of a budget.

Durability: SQLite runs in WAL mode with ``synchronous=FULL`` (a commit is on disk before the
call returns: before any private computation); PostgreSQL commits as configured on the server
(its default, ``synchronous_commit=on``, is the same promise). A write that only gives budget
back (a settlement below its reservation) may pass ``durable=False``: it is not waited for on
disk (SQLite ``synchronous=NORMAL`` for that commit, PostgreSQL ``synchronous_commit=off``), so a
power loss may undo it and leave the reservation counted in full: the safe direction; a process
crash (``kill -9``) loses nothing either way. A store that cannot be read or
written (disk full, a read-only file, the database down) raises ``LedgerUnavailable`` and
records nothing: requests that need it are refused (HTTP 503), never answered unaccounted.
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SCHEMA_VERSION = "1"
POSTGRES_PREFIXES = ("postgresql://", "postgres://")
SYNCHRONOUS = {"FULL": "FULL", "NORMAL": "NORMAL"}
BUSY_TIMEOUT_MS = 60_000  # SQLite: how long a transaction waits for another process's write lock

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS ledger_meta (
        name TEXT PRIMARY KEY, value TEXT NOT NULL)""",
    # entries (reservations, releases) written under each noise key's label, per ledger kind
    """CREATE TABLE IF NOT EXISTS ledger_keys (
        kind TEXT NOT NULL, key TEXT NOT NULL, entries BIGINT NOT NULL, PRIMARY KEY (kind, key))""",
    # one row per query: reserved before it runs, settled after (NULL settled_* until then)
    """CREATE TABLE IF NOT EXISTS query_reservations (
        id TEXT PRIMARY KEY, key TEXT NOT NULL, context TEXT NOT NULL, client TEXT NOT NULL,
        epsilon DOUBLE PRECISION NOT NULL, delta DOUBLE PRECISION NOT NULL,
        total_epsilon DOUBLE PRECISION NOT NULL, total_delta DOUBLE PRECISION NOT NULL,
        reserved_at DOUBLE PRECISION NOT NULL, settled_epsilon DOUBLE PRECISION,
        settled_delta DOUBLE PRECISION, settled_at DOUBLE PRECISION)""",
    # running spent per context (client '') and per client on it: double-double sums (hi + lo)
    """CREATE TABLE IF NOT EXISTS query_totals (
        key TEXT NOT NULL, context TEXT NOT NULL, client TEXT NOT NULL,
        epsilon_hi DOUBLE PRECISION NOT NULL, epsilon_lo DOUBLE PRECISION NOT NULL,
        delta_hi DOUBLE PRECISION NOT NULL, delta_lo DOUBLE PRECISION NOT NULL,
        queries BIGINT NOT NULL, PRIMARY KEY (key, context, client))""",
    # per-document budgets (document_ledger): each document's spending (client '') and each client's on it
    """CREATE TABLE IF NOT EXISTS document_spend (
        key TEXT NOT NULL, context TEXT NOT NULL, client TEXT NOT NULL, document TEXT NOT NULL,
        epsilon DOUBLE PRECISION NOT NULL, delta DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (key, context, client, document))""",
    """CREATE TABLE IF NOT EXISTS document_reservations (
        id TEXT PRIMARY KEY, key TEXT NOT NULL, context TEXT NOT NULL, client TEXT NOT NULL,
        epsilon DOUBLE PRECISION NOT NULL, delta DOUBLE PRECISION NOT NULL, active TEXT NOT NULL,
        reserved_at DOUBLE PRECISION NOT NULL, settled_at DOUBLE PRECISION)""",
    # released answers of mechanism answer, reused for the same question (post-processing)
    """CREATE TABLE IF NOT EXISTS answer_releases (
        key TEXT NOT NULL, question TEXT NOT NULL, fact TEXT, noisy_count DOUBLE PRECISION,
        epsilon DOUBLE PRECISION NOT NULL, delta DOUBLE PRECISION NOT NULL, time DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (key, question))""",
    """CREATE TABLE IF NOT EXISTS releases (
        key TEXT NOT NULL, subject TEXT NOT NULL, release TEXT NOT NULL,
        epsilon DOUBLE PRECISION NOT NULL, delta DOUBLE PRECISION NOT NULL, unit TEXT NOT NULL,
        time DOUBLE PRECISION NOT NULL, PRIMARY KEY (key, subject, release))""",
)


class LedgerUnavailable(RuntimeError):
    """The ledger cannot be read or written (disk full, a read-only file, the database down):
    nothing was recorded by the call that raised it."""


class Transaction:
    """One transaction's statements: SQL with ``?`` placeholders, in either dialect."""

    def __init__(self, cursor, placeholder: str, for_update: str, advisory: bool):
        self._cursor, self._placeholder, self.for_update = cursor, placeholder, for_update
        self._advisory = advisory

    def serialize(self, lock: int) -> None:
        """Hold lock ``lock`` until the transaction ends, for writes whose rows do not exist yet
        (PostgreSQL's advisory lock; a SQLite write transaction already holds the database)."""
        if self._advisory:
            self.execute("SELECT pg_advisory_xact_lock(?)", (lock,))

    def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        self._cursor.execute(sql.replace("?", self._placeholder), tuple(params))

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._cursor.executemany(sql.replace("?", self._placeholder), rows)

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple | None:
        self.execute(sql, params)
        return self._cursor.fetchone()

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        self.execute(sql, params)
        return self._cursor.fetchall()


class LedgerStore(ABC):
    """A database holding the ledgers; ``transaction`` is the only way in. Thread-safe (one
    connection, one transaction at a time per store object)."""

    location: str  # a file path, or the URL without its password: safe to print

    def __init__(self) -> None:
        self._mutex = threading.Lock()

    @contextmanager
    def transaction(self, *, write: bool, durable: bool = True) -> Iterator[Transaction]:
        """A transaction, committed when the block ends and rolled back if it raises. ``write``:
        take the write lock at once (a read-check-write that no other process interleaves).
        ``durable=False``: the commit need not reach the disk before the call returns (only for
        writes whose loss is safe: module doc)."""
        with self._mutex, self._errors(), self._begin(write, durable) as tx:
            yield tx

    def _create_schema(self, tx: Transaction) -> None:
        for statement in SCHEMA:
            tx.execute(statement)
        found = tx.one("SELECT value FROM ledger_meta WHERE name = 'schema'")
        if found is None:
            tx.execute("INSERT INTO ledger_meta (name, value) VALUES ('schema', ?)", (SCHEMA_VERSION,))
        elif found[0] != SCHEMA_VERSION:
            raise LedgerUnavailable(f"ledger {self.location} has schema version {found[0]}; this version of "
                                    f"vllm-dp reads version {SCHEMA_VERSION}")

    @abstractmethod
    def _begin(self, write: bool, durable: bool): ...

    @abstractmethod
    def _errors(self): ...

    @abstractmethod
    def close(self) -> None: ...


class SQLiteStore(LedgerStore):
    """A SQLite database file (created 0600 in a 0700 directory; WAL, ``synchronous=FULL``).
    ``synchronous="NORMAL"`` skips the fsync per commit: a commit then survives the process's
    crash but not the machine's (benchmarks use it to separate the disk's fsync from the work)."""

    def __init__(self, path: str | os.PathLike, synchronous: str = "FULL"):
        super().__init__()
        self.path = Path(path)
        self.location = str(self.path)
        with self._errors():
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not self.path.exists():  # SQLite gives its -wal and -shm files the database's mode
                os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
                os.chmod(self.path, 0o600)
            self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                         timeout=BUSY_TIMEOUT_MS / 1000)
            self._conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._synchronous = SYNCHRONOUS[synchronous]
            self._conn.execute(f"PRAGMA synchronous = {self._synchronous}")
        with self.transaction(write=True) as tx:
            self._create_schema(tx)

    @contextmanager
    def _begin(self, write: bool, durable: bool):
        cursor = self._conn.cursor()
        if not durable:  # set outside the transaction (SQLite ignores it inside one)
            cursor.execute("PRAGMA synchronous = NORMAL")
        try:
            cursor.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield Transaction(cursor, "?", "", advisory=False)
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
            cursor.execute("COMMIT")
        finally:
            if not durable:
                cursor.execute(f"PRAGMA synchronous = {self._synchronous}")

    @contextmanager
    def _errors(self):
        try:
            yield
        except sqlite3.IntegrityError:
            raise  # a broken invariant (a repeated id): a bug, not an outage
        except (sqlite3.OperationalError, sqlite3.DatabaseError, OSError) as exc:
            if self._conn_in_transaction():
                self._conn.execute("ROLLBACK")
            raise LedgerUnavailable(f"ledger {self.location}: {exc}") from exc

    def _conn_in_transaction(self) -> bool:
        conn = getattr(self, "_conn", None)
        try:
            return conn is not None and conn.in_transaction
        except sqlite3.ProgrammingError:
            return False

    def close(self) -> None:
        self._conn.close()


class PostgresStore(LedgerStore):
    """A PostgreSQL database (``psycopg``), shared by every server that names it. A lost
    connection is opened again at the next call."""

    def __init__(self, url: str):
        super().__init__()
        self.url = url
        self.location = _redact(url)
        self._conn = None
        with self.transaction(write=True) as tx:
            tx.serialize(SCHEMA_LOCK)  # CREATE TABLE IF NOT EXISTS races with itself
            self._create_schema(tx)

    def _connection(self):
        import psycopg

        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = psycopg.connect(self.url, autocommit=True)
        return self._conn

    @contextmanager
    def _begin(self, write: bool, durable: bool):
        conn = self._connection()
        with conn.transaction(), conn.cursor() as cursor:
            if not durable:
                cursor.execute("SET LOCAL synchronous_commit = off")
            yield Transaction(cursor, "%s", " FOR UPDATE", advisory=True)

    @contextmanager
    def _errors(self):
        import psycopg

        try:
            yield
        except psycopg.IntegrityError:
            raise
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            raise LedgerUnavailable(f"ledger {self.location}: {exc}") from exc

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


SCHEMA_LOCK = 0x7670_6470  # advisory lock ids of our own ("vpdp" + n)
RELEASE_LOCK = SCHEMA_LOCK + 1
DOCUMENT_LOCK = SCHEMA_LOCK + 2


def foreign_entries(tx: Transaction, kind: str, key: str) -> int:
    """Entries of ``kind`` written under another key label than ``key``."""
    row = tx.one("SELECT COALESCE(SUM(entries), 0) FROM ledger_keys WHERE kind = ? AND key <> ?", (kind, key))
    return int(row[0])


def count_entry(tx: Transaction, kind: str, key: str) -> None:
    """One more entry of ``kind`` under ``key``."""
    tx.execute("INSERT INTO ledger_keys (kind, key, entries) VALUES (?, ?, 1) "
               "ON CONFLICT (kind, key) DO UPDATE SET entries = ledger_keys.entries + 1", (kind, key))


def is_postgres(location: str | os.PathLike) -> bool:
    return str(location).startswith(POSTGRES_PREFIXES)


def open_store(location: str | os.PathLike) -> LedgerStore:
    """The store at ``location``: a ``postgresql://`` URL, or a SQLite file path (created)."""
    if is_postgres(location):
        return PostgresStore(str(location))
    return SQLiteStore(location)


def _redact(url: str) -> str:
    """``url`` without its password (``postgresql://user:***@host/db``)."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)
