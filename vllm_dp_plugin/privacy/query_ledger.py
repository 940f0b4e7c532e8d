"""A persistent budget for per-query releases on named private contexts: every query reserves
its (epsilon, delta) before it touches private data and settles what it actually spent after.

Guarantees:

* **No over-spending, even under concurrency.** ``reserve`` reads what a context has spent and
  records its reservation in one write transaction of the store (``ledger_store``: SQLite, or
  PostgreSQL shared by several servers), so threads, processes, machines and restarts sharing
  the store never grant more than the total between them.
* **Crash-safe.** A reservation is committed (on disk) before ``reserve`` returns, i.e. before any
  private computation; a crash afterwards leaves the full reserved amount counted (over-counting
  is the safe direction). A settlement is committed without waiting for the disk: a power cut may
  undo it, leaving the reservation counted in full, the same safe direction. A store that cannot
  be written raises ``LedgerUnavailable``.
* **Composition.** Queries use independent noise, so their budgets compose by basic composition
  (Dwork & Roth Thm 3.16): epsilons add, deltas add. A context's spent budget is the sum of the
  settled amounts of settled reservations plus the full amounts of unsettled ones.
* **Running totals.** Each (context, client) keeps its spent budget in a row of its own
  (double-double sums: exact to ~1e-26 relative), so a reservation reads two rows whatever the
  history's length.
* **Keyed.** The context and the client appear only as ``NoiseKey.label`` (keyed), and each
  reservation carries the label of the key that wrote it. Reservations written under another key
  cannot be matched to a context: their key file was lost or replaced, and every budget would
  silently restart at zero, so a store holding any refuses reservations (``ForeignEntries``, also
  raised by ``check_key`` at start-up) unless built with ``allow_foreign`` (then they are ignored
  and counted, ``foreign``, so a report can say the history is incomplete).
* **Client quotas.** A reservation may name a ``Quota`` (a client and its share of every
  context's total): it must then fit the context's total and the client's share of it.

The calls block (a commit waits for the disk): async callers run them in a thread. Ledgers of
earlier versions (one JSON line per event) are imported by ``ledger_migration``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .accountant import Budget
from .keyed_noise import ForeignEntries, NoiseKey
from .ledger_store import LedgerStore, Transaction, count_entry, foreign_entries, open_store
from .validation import check_delta, check_epsilon

REL_TOLERANCE = 1e-9  # float sums of many small epsilons may overshoot the total by rounding
ALLOW_FOREIGN_KEY = "aggregate.allow_foreign_ledger"  # the configuration key that allows foreign entries
ID_BYTES = 16
KIND = "query"  # the store's ledger kind (``ledger_keys``)


@dataclass(frozen=True)
class Quota:
    """A client's part of every context's budget: ``share`` (in (0, 1]) of its total."""

    client: str
    share: float

    def __post_init__(self) -> None:
        if not isinstance(self.client, str) or not self.client:
            raise ValueError(f"a client must be named by a non-empty string, got {self.client!r}")
        if isinstance(self.share, bool) or not isinstance(self.share, int | float) or not 0.0 < self.share <= 1.0:
            raise ValueError(f"a client's share must lie in (0, 1], got {self.share!r}")

    def of(self, total: Budget) -> Budget:
        return Budget(total.epsilon * self.share, total.delta * self.share)


class BudgetExhausted(RuntimeError):
    """A reservation would take a context (or a client's share of it) past its total; nothing
    was recorded. ``remaining`` is what the requester can still reserve."""

    def __init__(self, context: str, total: Budget, remaining: Budget, requested: Budget, location: str,
                 quota: Quota | None = None):
        self.context = context
        self.total = total
        self.remaining = remaining
        self.requested = requested
        self.quota = quota
        whose = (f"context {context!r}" if quota is None else
                 f"client {quota.client!r} (share {quota.share:g}) on context {context!r}")
        super().__init__(
            f"query budget of {whose} exhausted: requested {requested}, "
            f"remaining {remaining} of total {total} (ledger {location})"
        )


@dataclass(frozen=True)
class BudgetStatus:
    """A context's budget as recorded: ``spent`` composes every reservation (settled ones at
    their actual amount), ``remaining`` is ``total - spent`` clamped at 0, ``queries`` counts
    reservations, ``foreign`` counts ledger lines written under another key (unmatched). For a
    ``client`` (its quota): its share as ``total``, its reservations, and as ``remaining`` what it
    can still reserve (its share's remainder, at most the context's)."""

    context: str
    total: Budget
    spent: Budget
    remaining: Budget
    queries: int
    foreign: int = 0
    client: str | None = None

    def to_json(self) -> dict:
        return {
            "context": self.context,
            **({} if self.client is None else {"client": self.client}),
            "total": _budget_json(self.total),
            "spent": _budget_json(self.spent),
            "remaining": _budget_json(self.remaining),
            "queries": self.queries,
            "entries_under_other_keys": self.foreign,
        }


@dataclass(frozen=True)
class Reservation:
    """A recorded reservation of ``amount`` on ``context`` (by ``quota``'s client, if any), to
    be settled once with ``settle``."""

    context: str
    id: str
    amount: Budget
    quota: Quota | None = None


class QueryLedger:
    """The query-budget record in ``store`` (a ``LedgerStore``, or a location ``open_store``
    opens: a SQLite path or a ``postgresql://`` URL), keyed by ``key``. Safe to share between
    threads, processes and machines on one store: every call is one locked transaction.
    ``allow_foreign``: reserve even though the store holds entries written under another key.
    ``writes`` counts the write transactions this object ran (under the store's lock): a copy of
    its statuses is out of date, as far as this process wrote, once it moved."""

    def __init__(self, key: NoiseKey, store: LedgerStore | str | os.PathLike, allow_foreign: bool = False):
        self._key = key
        self.store = store if isinstance(store, LedgerStore) else open_store(store)
        self.location = self.store.location
        self.allow_foreign = allow_foreign
        self._key_label = key.label("query-ledger/key")
        self.writes = 0

    def reserve(self, context: str, total: Budget, amount: Budget, quota: Quota | None = None) -> Reservation:
        """Record that a query on ``context`` (budget ``total``) is about to spend ``amount``,
        on behalf of ``quota``'s client when given.

        Raises ``ForeignEntries`` (and writes nothing) if the store holds entries written under
        another key, unless ``allow_foreign``.
        Atomic: in one write transaction, if the context's spent budget plus ``amount`` exceeds
        ``total`` in epsilon or delta (beyond a relative tolerance of 1e-9), or the client's
        spent budget on the context plus ``amount`` exceeds its share of ``total``, raises
        ``BudgetExhausted`` and writes nothing; otherwise commits a reservation with a fresh
        random id before returning it. Call it before any private computation."""
        context = _check_context(context)
        total = _check_total(total)
        amount = _check_amount(amount, "amount")
        label, client = self._context_label(context), self._client_label(quota)
        with self.store.transaction(write=True) as tx:
            self._refuse_foreign(foreign_entries(tx, KIND, self._key_label))
            spent = self._tally(tx, label, "", lock=True).spent
            if not _fits(spent, amount, total):
                raise BudgetExhausted(context, total, _remaining(total, spent), amount, self.location)
            if quota is not None:
                share, used = quota.of(total), self._tally(tx, label, client, lock=True).spent
                if not _fits(used, amount, share):
                    left = _least(_remaining(share, used), _remaining(total, spent))
                    raise BudgetExhausted(context, share, left, amount, self.location, quota)
            rid = os.urandom(ID_BYTES).hex()
            insert_reservation(tx, self._key_label, rid, label, client, amount, total, time.time())
            self.writes += 1
        return Reservation(context, rid, amount, quota)

    def settle(self, reservation: Reservation, actual: Budget) -> BudgetStatus:
        """Record that ``reservation``'s query spent ``actual`` (at most the reserved amount) and
        return the context's status against the total the reservation was checked against (its
        client's status, when it was made under a quota).

        Raises ``ValueError`` (and writes nothing) if the reservation is not in the ledger under
        this key, was already settled, does not match the recorded amount, or if ``actual``
        exceeds the reserved amount in epsilon or delta."""
        context = _check_context(reservation.context)
        actual = _check_amount(actual, "actual")
        label, client = self._context_label(context), self._client_label(reservation.quota)
        # not waited for on disk: a settlement only gives back budget, so losing it to a power cut
        # leaves the reservation counted in full (ledger_store: durable=False)
        with self.store.transaction(write=True, durable=False) as tx:
            row = tx.one("SELECT key, context, client, epsilon, delta, total_epsilon, total_delta, settled_at "
                         f"FROM query_reservations WHERE id = ?{tx.for_update}", (reservation.id,))
            if row is None or row[:3] != (self._key_label, label, client):
                raise ValueError(f"reservation {reservation.id!r} of context {context!r} is not in ledger "
                                 f"{self.location} under this key")
            reserved, total = Budget(row[3], row[4]), Budget(row[5], row[6])
            if row[7] is not None:
                raise ValueError(f"reservation {reservation.id!r} of context {context!r} is already settled")
            if reserved != reservation.amount:
                raise ValueError(f"reservation {reservation.id!r} claims {reservation.amount} but the ledger "
                                 f"recorded {reserved}")
            if _exceeds(actual.epsilon, reserved.epsilon) or _exceeds(actual.delta, reserved.delta):
                raise ValueError(f"actual spending {actual} exceeds the reserved {reservation.amount} of "
                                 f"context {context!r}: reserve the larger amount before computing")
            settle_reservation(tx, self._key_label, reservation.id, label, client, reserved, actual, time.time())
            self.writes += 1
            return self._status(tx, context, total, reservation.quota)

    def status(self, context: str, total: Budget, quota: Quota | None = None) -> BudgetStatus:
        """``context``'s budget as recorded, against ``total``, or ``quota``'s client's on it.
        Reservations not yet settled count in full."""
        context = _check_context(context)
        total = _check_total(total)
        with self.store.transaction(write=False) as tx:
            return self._status(tx, context, total, quota)

    def statuses(self, contexts: Sequence[str], total: Budget,
                 quotas: Sequence[Quota] = ()) -> dict[tuple[str, str | None], BudgetStatus]:
        """``status`` of every context in ``contexts`` (key ``(context, None)``) and of every
        quota's client on it (``(context, client)``), all read in one transaction: one acquisition
        of the store's lock, which every reservation takes too, whatever the number of contexts
        and clients."""
        contexts = [_check_context(c) for c in contexts]
        total = _check_total(total)
        with self.store.transaction(write=False) as tx:
            return {(c, None if q is None else q.client): self._status(tx, c, total, q)
                    for c in contexts for q in (None, *quotas)}

    def check_key(self) -> int:
        """Raise ``ForeignEntries`` if the store holds entries written under another key (a lost
        or replaced key file) and ``allow_foreign`` is off; else return how many it holds. Call
        it at start-up, before the first query."""
        with self.store.transaction(write=False) as tx:
            foreign = foreign_entries(tx, KIND, self._key_label)
        self._refuse_foreign(foreign)
        return foreign

    def _refuse_foreign(self, foreign: int) -> None:
        if foreign and not self.allow_foreign:
            raise ForeignEntries("query ledger", self.location, foreign, self._key,
                                 "the budgets they recorded cannot be read and every collection's spending "
                                 "would restart at zero", ALLOW_FOREIGN_KEY)

    def _status(self, tx: Transaction, context: str, total: Budget, quota: Quota | None) -> BudgetStatus:
        label = self._context_label(context)
        foreign = foreign_entries(tx, KIND, self._key_label)
        tally = self._tally(tx, label, "")
        spent, remaining = tally.spent, _remaining(total, tally.spent)
        if quota is None:
            return BudgetStatus(context, total, spent, remaining, tally.queries, foreign)
        share, mine = quota.of(total), self._tally(tx, label, self._client_label(quota))
        left = _least(_remaining(share, mine.spent), remaining)
        return BudgetStatus(context, share, mine.spent, left, mine.queries, foreign, quota.client)

    def _tally(self, tx: Transaction, label: str, client: str, lock: bool = False) -> Tally:
        return read_tally(tx, self._key_label, label, client, lock)

    def _context_label(self, context: str) -> str:
        return self._key.label("query-ledger/context", context)

    def _client_label(self, quota: Quota | None) -> str:
        return "" if quota is None else self._key.label("query-ledger/client", quota.client)


@dataclass(frozen=True)
class Tally:
    """A running spent budget as stored: double-double sums (``hi + lo`` carries ~106 bits, so
    a million additions and refunds stay exact to ~1e-26 relative) and the reservations counted."""

    epsilon_hi: float = 0.0
    epsilon_lo: float = 0.0
    delta_hi: float = 0.0
    delta_lo: float = 0.0
    queries: int = 0

    @property
    def spent(self) -> Budget:
        return Budget(self.epsilon_hi + self.epsilon_lo, self.delta_hi + self.delta_lo)

    def plus(self, epsilon: float, delta: float, queries: int = 0) -> Tally:
        return Tally(*_add2(self.epsilon_hi, self.epsilon_lo, epsilon), *_add2(self.delta_hi, self.delta_lo, delta),
                     self.queries + queries)


def read_tally(tx: Transaction, key: str, context: str, client: str, lock: bool = False) -> Tally:
    """The stored running total of (``context``, ``client``) (client "": the context's); ``lock``:
    held ``FOR UPDATE`` until the transaction ends (PostgreSQL; SQLite locks the database)."""
    if lock:  # a row to lock: two first reservations of a context must not both read "none"
        tx.execute("INSERT INTO query_totals (key, context, client, epsilon_hi, epsilon_lo, delta_hi, delta_lo, "
                   "queries) VALUES (?, ?, ?, 0, 0, 0, 0, 0) ON CONFLICT (key, context, client) DO NOTHING",
                   (key, context, client))
    row = tx.one("SELECT epsilon_hi, epsilon_lo, delta_hi, delta_lo, queries FROM query_totals "
                 f"WHERE key = ? AND context = ? AND client = ?{tx.for_update if lock else ''}",
                 (key, context, client))
    return Tally() if row is None else Tally(*row)


def insert_reservation(tx: Transaction, key: str, rid: str, context: str, client: str, amount: Budget,
                       total: Budget, when: float, settled: Budget | None = None,
                       settled_at: float | None = None) -> None:
    """A reservation's row, counted in its context's (and client's) running total: its
    ``settled`` amount if given (a migrated, already settled one), else its full amount."""
    tx.execute("INSERT INTO query_reservations (id, key, context, client, epsilon, delta, total_epsilon, "
               "total_delta, reserved_at, settled_epsilon, settled_delta, settled_at) "
               "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
               (rid, key, context, client, amount.epsilon, amount.delta, total.epsilon, total.delta, when,
                None if settled is None else settled.epsilon, None if settled is None else settled.delta,
                settled_at))
    counted = amount if settled is None else settled
    _add_to_totals(tx, key, context, client, counted.epsilon, counted.delta, 1)
    count_entry(tx, KIND, key)


def settle_reservation(tx: Transaction, key: str, rid: str, context: str, client: str, reserved: Budget,
                       actual: Budget, when: float) -> None:
    """Mark a reservation settled at ``actual``: its totals trade the reserved amount for it."""
    tx.execute("UPDATE query_reservations SET settled_epsilon = ?, settled_delta = ?, settled_at = ? WHERE id = ?",
               (actual.epsilon, actual.delta, when, rid))
    _add_to_totals(tx, key, context, client, actual.epsilon, actual.delta, 0, reserved)


def _add_to_totals(tx: Transaction, key: str, context: str, client: str, epsilon: float, delta: float,
                   queries: int, minus: Budget | None = None) -> None:
    for who in ("", client) if client else ("",):
        tally = read_tally(tx, key, context, who, lock=True).plus(epsilon, delta, queries)
        if minus is not None:
            tally = tally.plus(-minus.epsilon, -minus.delta)
        tx.execute("INSERT INTO query_totals (key, context, client, epsilon_hi, epsilon_lo, delta_hi, delta_lo, "
                   "queries) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (key, context, client) DO UPDATE SET "
                   "epsilon_hi = excluded.epsilon_hi, epsilon_lo = excluded.epsilon_lo, "
                   "delta_hi = excluded.delta_hi, delta_lo = excluded.delta_lo, queries = excluded.queries",
                   (key, context, who, tally.epsilon_hi, tally.epsilon_lo, tally.delta_hi, tally.delta_lo,
                    tally.queries))


def _add2(hi: float, lo: float, x: float) -> tuple[float, float]:
    """``(hi, lo) + x`` in double-double arithmetic (Knuth's TwoSum, then renormalised)."""
    s = hi + x
    v = s - hi
    lo = lo + ((hi - (s - v)) + (x - v))
    high = s + lo
    return high, lo - (high - s)


def _remaining(total: Budget, spent: Budget) -> Budget:
    return Budget(max(0.0, total.epsilon - spent.epsilon), max(0.0, total.delta - spent.delta))


def _least(a: Budget, b: Budget) -> Budget:
    return Budget(min(a.epsilon, b.epsilon), min(a.delta, b.delta))


def _fits(spent: Budget, amount: Budget, total: Budget) -> bool:
    """``spent + amount`` within ``total`` in epsilon and delta (up to the relative tolerance)."""
    return not (_exceeds(spent.epsilon + amount.epsilon, total.epsilon)
                or _exceeds(spent.delta + amount.delta, total.delta))


def _exceeds(value: float, limit: float) -> bool:
    return value > limit and not math.isclose(value, limit, rel_tol=REL_TOLERANCE, abs_tol=0.0)


def _check_context(context: str) -> str:
    if not isinstance(context, str) or not context:
        raise ValueError(f"a private context must be named by a non-empty string, got {context!r}")
    return context


def _check_total(total: Budget) -> Budget:
    """A context's total: epsilon > 0, delta in [0, 1)."""
    return Budget(check_epsilon(total.epsilon, "total.epsilon"),
                  check_delta(total.delta, "total.delta", allow_zero=True))


def _check_amount(amount: Budget, name: str) -> Budget:
    """A query's amount: epsilon >= 0 (0 for a query that releases nothing), delta in [0, 1)."""
    try:
        epsilon = check_epsilon(amount.epsilon, f"{name}.epsilon")
    except ValueError:
        value = amount.epsilon
        if not (isinstance(value, int | float) and not isinstance(value, bool) and value == 0):
            raise ValueError(f"{name}.epsilon must be a finite number >= 0, got {value!r}") from None
        epsilon = 0.0
    return Budget(epsilon, check_delta(amount.delta, f"{name}.delta", allow_zero=True))


def _budget_json(budget: Budget) -> dict:
    return {"epsilon": budget.epsilon, "delta": budget.delta}

