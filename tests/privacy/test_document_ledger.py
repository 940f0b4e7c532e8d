"""Per-document budgets (``privacy.document_ledger``), in SQLite and PostgreSQL: a reservation
charges only documents with room under their cap (and under a client's share of it), a settlement
keeps the charge only where the document took part, spending persists across restarts and a
crash leaves the reservation charged, concurrent queries never take a document past its cap, and
every write has the collection's shape (not the number of documents charged)."""

import threading

import numpy as np
import pytest

from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.document_ledger import DocumentLedger
from vllm_dp_plugin.privacy.query_ledger import Quota

CAP, COST = Budget(10.0, 1e-5), Budget(4.0, 1e-6)


@pytest.fixture
def ledger(key, ledger_location):
    return DocumentLedger(key, ledger_location)


def docs(ledger, n=4):
    return ledger.labels("ctx", [f"doc-{i}" for i in range(n)])


def test_only_the_documents_that_took_part_are_charged_and_each_stops_at_its_cap(ledger):
    labels = docs(ledger)
    first = ledger.reserve("ctx", labels, COST, CAP)
    assert first.active.all()
    np.testing.assert_allclose(ledger.spent("ctx", labels)[:, 0], [4, 4, 4, 4])  # reserved: the worst case
    ledger.settle(first, np.array([True, False, False, False]))
    np.testing.assert_allclose(ledger.spent("ctx", labels), [[4, 1e-6], [0, 0], [0, 0], [0, 0]])
    ledger.settle(ledger.reserve("ctx", labels, COST, CAP), np.array([True, True, False, False]))
    third = ledger.reserve("ctx", labels, COST, CAP)  # doc 0 at 8: a third 4 would pass 10
    assert third.active.tolist() == [False, True, True, True]
    ledger.settle(third, np.array([False, True, False, False]))
    np.testing.assert_allclose(ledger.spent("ctx", labels)[:, 0], [8, 8, 0, 0])
    assert ledger.reserve("ctx", labels, Budget(2.0, 1e-6), CAP).active.all()  # 8 + 2 fits exactly


def test_a_charge_outside_the_reservation_and_a_second_settlement_are_refused(ledger):
    labels = docs(ledger, 2)
    ledger.settle(ledger.reserve("ctx", labels, COST, CAP), np.array([True, False]))
    full = ledger.reserve("ctx", labels, Budget(7.0, 0.0), CAP)
    assert full.active.tolist() == [False, True]
    with pytest.raises(ValueError, match="only where the reservation made it active"):
        ledger.settle(full, np.array([True, False]))
    ledger.settle(full, np.array([False, False]))
    with pytest.raises(ValueError, match="already settled"):
        ledger.settle(full, np.array([False, False]))


def test_spending_survives_a_restart_and_a_crash_leaves_the_reservation_charged(key, ledger_location):
    first = DocumentLedger(key, ledger_location)
    labels = docs(first, 3)
    first.settle(first.reserve("ctx", labels, COST, CAP), np.array([False, True, False]))
    first.reserve("ctx", labels, COST, CAP)  # the server dies before settling
    again = DocumentLedger(key, ledger_location)
    np.testing.assert_allclose(again.spent("ctx", labels)[:, 0], [4, 8, 4])
    assert again.reserve("ctx", labels, COST, CAP).active.tolist() == [True, False, True]


def test_a_document_keeps_its_spending_whatever_else_the_collection_holds(ledger):
    """Rows follow the document's id: removing another document, or re-adding this one, does
    not reset what it spent."""
    labels = docs(ledger, 3)
    ledger.settle(ledger.reserve("ctx", labels, COST, CAP), np.array([False, False, True]))
    later = ledger.labels("ctx", ["doc-2", "doc-7"])
    np.testing.assert_allclose(ledger.spent("ctx", later)[:, 0], [4, 0])


def test_a_client_spends_at_most_its_share_of_each_documents_cap(ledger):
    labels = docs(ledger, 2)
    alice, bob = Quota("alice", 0.5), Quota("bob", 1.0)
    ledger.settle(ledger.reserve("ctx", labels, COST, CAP, alice), np.array([True, True]))
    mine = ledger.reserve("ctx", labels, COST, CAP, alice)  # 4 + 4 > 5: alice is done with both
    assert not mine.active.any()
    ledger.settle(mine, np.array([False, False]))
    theirs = ledger.reserve("ctx", labels, COST, CAP, bob)  # 4 + 4 <= 10: bob still reaches them
    assert theirs.active.all()
    ledger.settle(theirs, np.array([True, False]))
    np.testing.assert_allclose(ledger.spent("ctx", labels)[:, 0], [8, 4])
    np.testing.assert_allclose(ledger.spent("ctx", labels, alice)[:, 0], [4, 4])


def test_concurrent_queries_never_take_a_document_past_its_cap(ledger):
    labels = docs(ledger, 3)
    taken = []

    def worker():
        for _ in range(10):
            reservation = ledger.reserve("ctx", labels, Budget(1.0, 0.0), CAP)
            taken.append(reservation.active.copy())
            ledger.settle(reservation, reservation.active)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert np.sum(taken, axis=0).tolist() == [10, 10, 10]
    np.testing.assert_allclose(ledger.spent("ctx", labels)[:, 0], [10, 10, 10])


def test_every_write_has_the_collections_shape(ledger, monkeypatch):
    """A reservation and a settlement write every document's row, charged or not: the ledger's
    time does not tell how many documents took part."""
    labels = docs(ledger, 5)
    written = []
    original = DocumentLedger._write

    def spy(self, tx, context, client, documents, spent):
        written.append(len(documents))
        return original(self, tx, context, client, documents, spent)

    monkeypatch.setattr(DocumentLedger, "_write", spy)
    for charged in ([False] * 5, [True] + [False] * 4, [True] * 5):
        ledger.settle(ledger.reserve("ctx", labels, Budget(1.0, 0.0), CAP), np.array(charged))
    assert written == [5] * 6


def test_rows_hold_keyed_labels_only(ledger, key, tmp_path):
    import sqlite3

    path = tmp_path / "plain.sqlite"
    plain = DocumentLedger(key, path)
    plain.settle(plain.reserve("secret-ctx", plain.labels("secret-ctx", ["secret-doc"]), COST, CAP),
                 np.array([True]))
    dump = "\n".join(sqlite3.connect(path).iterdump())
    assert "secret-doc" not in dump and "secret-ctx" not in dump
