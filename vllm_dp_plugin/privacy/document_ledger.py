"""Per-document budgets: an individual privacy filter for each document of a collection.

Each document has a lifetime cap (``cap``: epsilon and delta). A query first reserves its cost
(``reserve``) on every document whose spending (and, with a client quota, whose spending by that
client, against the client's share of the cap) still leaves room for it: those are *active*, the
others do not take part in the query. After the query it settles (``settle``): only the active
documents that took part keep the charge (under ``mechanism: answer``: the members that voted),
the rest are refunded. A document whose cap would be exceeded thus silently stops taking part.

Why that is DP per document (docs/aggregation.md, "Per-document budgets"): a query in which a
document does not take part computes the same output distribution with or without it (its
individual privacy loss is 0); one in which it takes part is (epsilon, delta)-DP with respect to
it. Whether it takes part is a function of the document itself and the public history (the
questions and earlier releases), and the filter keeps the sum of its losses within its cap with
probability 1: the individual filter of Feldman and Zrnic (NeurIPS 2021, in RDP) with basic
composition for approximate DP under fully adaptive choice (Whitehouse et al., ICML 2023), per
document. So each document is (cap epsilon, cap delta)-DP over the server's lifetime, against all
clients together.

Every sum over documents is private: how many took part, how many are exhausted. Nothing of this
ledger leaves the server but through the operator (``spent``). Its writes have a constant shape:
a reservation and a settlement each write every document's row (the collection's size is public),
so their time does not tell how many documents were active or charged. Rows are keyed labels of
the document ids (``NoiseKey.label``): a document keeps its spending across restarts, edits and
removal (re-adding it continues where it stopped).

Crash safety as the query ledger: a reservation is committed on disk before the query reads
any document; a settlement only gives budget back and is not waited for on disk.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .accountant import Budget
from .keyed_noise import NoiseKey
from .ledger_store import DOCUMENT_LOCK, LedgerStore, Transaction, open_store
from .query_ledger import REL_TOLERANCE, Quota, _check_amount, _check_context, _check_total

ID_BYTES = 16


@dataclass(frozen=True)
class DocumentReservation:
    """A recorded reservation of ``cost`` on each ``active`` document of ``context`` (a mask over
    the ``documents`` the reservation was made with), to be settled once. SECRET: ``active``."""

    context: str
    id: str
    documents: tuple[str, ...]
    active: np.ndarray  # bool [N]
    cost: Budget
    quota: Quota | None = None


class DocumentLedger:
    """Per-document spending of collections in ``store`` (shared with the query ledger: one
    SQLite file or PostgreSQL database), keyed by ``key``. Each call is one locked transaction."""

    def __init__(self, key: NoiseKey, store: LedgerStore | str | os.PathLike):
        self._key = key
        self.store = store if isinstance(store, LedgerStore) else open_store(store)
        self._key_label = key.label("document-ledger/key")

    def labels(self, context: str, document_ids: Sequence[str]) -> tuple[str, ...]:
        """The keyed labels the ledger stores ``document_ids`` of ``context`` under."""
        return tuple(self._key.label("document-ledger/document", context, doc) for doc in document_ids)

    def reserve(self, context: str, documents: Sequence[str], cost: Budget, cap: Budget,
                quota: Quota | None = None, rid: str | None = None) -> DocumentReservation:
        """Charge ``cost`` to every document (``labels``) whose spending plus ``cost`` stays
        within ``cap`` and, with ``quota``, whose spending by that client stays within its share
        of ``cap``; return which (``active``). Committed before it returns; every row written.
        ``rid``: the reservation's id (default: random), for a one-shot release that must find
        its reservation again after a restart (``reserved``)."""
        context, cap = _check_context(context), _check_total(cap)
        cost = _check_amount(cost, "cost")
        documents, label = tuple(documents), self._context(context)
        client = self._client(quota)
        with self.store.transaction(write=True) as tx:
            tx.serialize(DOCUMENT_LOCK)  # PostgreSQL: rows not written yet cannot be locked
            spent = self._read(tx, label, "", documents)
            active = _fits(spent, cost, cap)
            if quota is not None:
                mine = self._read(tx, label, client, documents)
                active &= _fits(mine, cost, quota.of(cap))
                self._write(tx, label, client, documents, mine + active[:, None] * _vector(cost))
            self._write(tx, label, "", documents, spent + active[:, None] * _vector(cost))
            rid = rid or os.urandom(ID_BYTES).hex()
            tx.execute("INSERT INTO document_reservations (id, key, context, client, epsilon, delta, active, "
                       "reserved_at, settled_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, NULL)",
                       (rid, self._key_label, label, client, cost.epsilon, cost.delta, _mask(active), time.time()))
        return DocumentReservation(context, rid, documents, active, cost, quota)

    def settle(self, reservation: DocumentReservation, charged: np.ndarray) -> None:
        """Keep the charge on the active documents that took part (``charged``, a bool mask);
        refund the others. ValueError (nothing written) for a settled or unknown reservation or
        a charged document that was not active."""
        charged = np.asarray(charged, dtype=bool)
        if charged.shape != reservation.active.shape or (charged & ~reservation.active).any():
            raise ValueError("a document can be charged only where the reservation made it active")
        refund = (reservation.active & ~charged)[:, None] * _vector(reservation.cost)
        client, documents = self._client(reservation.quota), reservation.documents
        label = self._context(reservation.context)
        with self.store.transaction(write=True, durable=False) as tx:
            tx.serialize(DOCUMENT_LOCK)
            row = tx.one("SELECT key, context, client, settled_at FROM document_reservations "
                         f"WHERE id = ?{tx.for_update}", (reservation.id,))
            if row is None or row[:3] != (self._key_label, label, client):
                raise ValueError(f"document reservation {reservation.id!r} is not in ledger {self.store.location}")
            if row[3] is not None:
                raise ValueError(f"document reservation {reservation.id!r} is already settled")
            for who in ("", client) if client else ("",):
                spent = self._read(tx, label, who, documents)
                self._write(tx, label, who, documents, np.maximum(spent - refund, 0.0))
            tx.execute("UPDATE document_reservations SET settled_at = ? WHERE id = ?", (time.time(), reservation.id))

    def reserved(self, context: str, rid: str, documents: Sequence[str]) -> np.ndarray | None:
        """The ``active`` mask of reservation ``rid`` of ``context`` over ``documents`` (those it
        was made with), or None when there is none."""
        with self.store.transaction(write=False) as tx:
            row = tx.one("SELECT active FROM document_reservations WHERE id = ? AND key = ? AND context = ?",
                         (rid, self._key_label, self._context(_check_context(context))))
        if row is None:
            return None
        return np.unpackbits(np.frombuffer(bytes.fromhex(row[0]), dtype=np.uint8))[:len(documents)].astype(bool)

    def spent(self, context: str, documents: Sequence[str], quota: Quota | None = None) -> np.ndarray:
        """What each document spent (``[N, 2]``: epsilon, delta; by ``quota``'s client when
        given). OPERATOR ONLY: never part of a response."""
        with self.store.transaction(write=False) as tx:
            return self._read(tx, self._context(_check_context(context)), self._client(quota), tuple(documents))

    def _context(self, context: str) -> str:
        return self._key.label("document-ledger/context", context)

    def _client(self, quota: Quota | None) -> str:
        return "" if quota is None else self._key.label("document-ledger/client", quota.client)

    def _read(self, tx: Transaction, context: str, client: str, documents: tuple[str, ...]) -> np.ndarray:
        rows = {doc: (eps, delta) for doc, eps, delta in tx.all(
            "SELECT document, epsilon, delta FROM document_spend WHERE key = ? AND context = ? AND client = ?"
            f"{tx.for_update}", (self._key_label, context, client))}
        return np.array([rows.get(doc, (0.0, 0.0)) for doc in documents], dtype=np.float64).reshape(-1, 2)

    def _write(self, tx: Transaction, context: str, client: str, documents: tuple[str, ...],
               spent: np.ndarray) -> None:
        tx.executemany("INSERT INTO document_spend (key, context, client, document, epsilon, delta) "
                       "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key, context, client, document) DO UPDATE SET "
                       "epsilon = excluded.epsilon, delta = excluded.delta",
                       [(self._key_label, context, client, doc, float(e), float(d))
                        for doc, (e, d) in zip(documents, spent, strict=True)])


def _vector(b: Budget) -> np.ndarray:
    return np.array([b.epsilon, b.delta], dtype=np.float64)


def _fits(spent: np.ndarray, cost: Budget, cap: Budget) -> np.ndarray:
    """Per document: ``spent + cost`` within ``cap`` in epsilon and delta (relative tolerance as
    the query ledger's)."""
    limit = _vector(cap)
    after = spent + _vector(cost)
    return np.all((after <= limit) | np.isclose(after, limit, rtol=REL_TOLERANCE, atol=0.0), axis=1)


def _mask(active: np.ndarray) -> str:
    """A fixed-width record of ``active`` (hex of its bits; its length depends on N only)."""
    return np.packbits(active.astype(np.uint8)).tobytes().hex()

