"""The query ledger, in SQLite and in PostgreSQL (``ledger_location``: both, each test on a fresh
store): reserve-before-compute, settle, refusal at the total, persistence across restarts, crash
safety, keyed entries only, no over-spending under concurrent processes and threads, exact
running totals, client quotas, and a store that cannot be written refusing without recording."""

import json
import math
import multiprocessing
import os
import sqlite3
import stat
import threading

import numpy as np
import pytest

from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.keyed_noise import ForeignEntries, NoiseKey
from vllm_dp_plugin.privacy.ledger_store import LedgerUnavailable, open_store
from vllm_dp_plugin.privacy.query_ledger import (
    BudgetExhausted,
    BudgetStatus,
    QueryLedger,
    Quota,
    Reservation,
)

TOTAL = Budget(3.0, 1e-5)


@pytest.fixture
def ledger(key, ledger_location):
    return QueryLedger(key, ledger_location)


def _rows(ledger) -> list[dict]:
    """Every reservation row the store holds, as a mapping."""
    names = ("id", "key", "context", "client", "epsilon", "delta", "settled_epsilon", "settled_at")
    with ledger.store.transaction(write=False) as tx:
        rows = tx.all(f"SELECT {', '.join(names)} FROM query_reservations ORDER BY reserved_at")
    return [dict(zip(names, row, strict=True)) for row in rows]


def test_reserve_settle_status_arithmetic(ledger):
    first = ledger.reserve("ctx", TOTAL, Budget(1.0, 2e-6))
    assert isinstance(first, Reservation) and first.context == "ctx" and first.amount == Budget(1.0, 2e-6)
    second = ledger.reserve("ctx", TOTAL, Budget(0.5, 1e-6))
    assert first.id != second.id
    # unsettled reservations count in full
    status = ledger.status("ctx", TOTAL)
    assert status.queries == 2
    assert status.spent.epsilon == pytest.approx(1.5) and status.spent.delta == pytest.approx(3e-6)
    assert status.remaining.epsilon == pytest.approx(1.5) and status.remaining.delta == pytest.approx(7e-6)
    # settling at less than reserved gives the difference back
    settled = ledger.settle(first, Budget(0.25, 0.0))
    assert isinstance(settled, BudgetStatus)
    assert settled.total == TOTAL and settled.queries == 2
    assert settled.spent.epsilon == pytest.approx(0.75) and settled.spent.delta == pytest.approx(1e-6)
    assert settled.remaining.epsilon == pytest.approx(2.25) and settled.remaining.delta == pytest.approx(9e-6)
    assert ledger.status("ctx", TOTAL) == settled
    # other contexts are accounted separately
    assert ledger.status("other", TOTAL).spent == Budget(0.0, 0.0)
    assert ledger.status("other", TOTAL).queries == 0
    as_json = settled.to_json()
    assert as_json["spent"]["epsilon"] == pytest.approx(0.75) and as_json["queries"] == 2
    assert as_json["total"] == {"epsilon": 3.0, "delta": 1e-5}
    assert json.dumps(as_json)  # serialisable


def test_exceeding_the_total_is_refused_and_writes_nothing(ledger):
    ledger.reserve("ctx", TOTAL, Budget(2.0, 0.0))
    before = _rows(ledger)
    with pytest.raises(BudgetExhausted, match="'ctx'") as info:
        ledger.reserve("ctx", TOTAL, Budget(1.5, 0.0))
    assert info.value.remaining == Budget(1.0, 1e-5)
    assert info.value.requested == Budget(1.5, 0.0)
    assert "remaining" in str(info.value) and "requested" in str(info.value)
    assert _rows(ledger) == before
    # delta alone can exhaust it too
    with pytest.raises(BudgetExhausted):
        ledger.reserve("ctx", TOTAL, Budget(0.1, 2e-5))
    assert _rows(ledger) == before
    # exactly what is left still fits, then nothing more
    ledger.reserve("ctx", TOTAL, Budget(1.0, 1e-5))
    with pytest.raises(BudgetExhausted) as info:
        ledger.reserve("ctx", TOTAL, Budget(1e-6, 0.0))
    assert info.value.remaining == Budget(0.0, 0.0)
    assert ledger.status("ctx", TOTAL).queries == 2


def test_float_sums_at_the_total_are_tolerated(ledger):
    total = Budget(0.3, 0.0)
    for _ in range(3):
        ledger.reserve("ctx", total, Budget(0.1, 0.0))  # 0.2 + 0.1 = 0.30000000000000004 > 0.3
    assert ledger.status("ctx", total).queries == 3
    with pytest.raises(BudgetExhausted):
        ledger.reserve("ctx", total, Budget(1e-6, 0.0))


def test_state_persists_across_restarts(key, tmp_path, ledger_location):
    path = ledger_location
    reservation = QueryLedger(key, path).reserve("ctx", TOTAL, Budget(2.0, 0.0))
    restarted = QueryLedger(NoiseKey(tmp_path / "noise.key"), path)
    assert restarted.status("ctx", TOTAL).spent == Budget(2.0, 0.0)
    # a reservation made before the restart can be settled after it
    assert restarted.settle(reservation, Budget(1.0, 0.0)).spent == Budget(1.0, 0.0)
    assert QueryLedger(key, path).status("ctx", TOTAL).remaining == Budget(2.0, 1e-5)
    with pytest.raises(BudgetExhausted):
        QueryLedger(key, path).reserve("ctx", TOTAL, Budget(2.5, 0.0))


def test_a_crash_after_reserve_counts_the_full_reservation(key, ledger_location):
    path = ledger_location
    crashed = QueryLedger(key, path)
    crashed.reserve("ctx", TOTAL, Budget(2.5, 1e-6))
    crashed.store.close()  # the query died before settling
    status = QueryLedger(key, path).status("ctx", TOTAL)
    assert status.spent == Budget(2.5, 1e-6) and status.queries == 1
    with pytest.raises(BudgetExhausted):
        QueryLedger(key, path).reserve("ctx", TOTAL, Budget(1.0, 0.0))


def test_bad_settlements_are_refused(ledger):
    reservation = ledger.reserve("ctx", TOTAL, Budget(1.0, 1e-6))
    before = _rows(ledger)
    with pytest.raises(ValueError, match="exceeds the reserved"):
        ledger.settle(reservation, Budget(1.5, 0.0))
    with pytest.raises(ValueError, match="exceeds the reserved"):
        ledger.settle(reservation, Budget(1.0, 2e-6))
    with pytest.raises(ValueError, match="not in ledger"):
        ledger.settle(Reservation("ctx", "0" * 32, Budget(1.0, 1e-6)), Budget(0.5, 0.0))
    with pytest.raises(ValueError, match="not in ledger"):  # right id, wrong context
        ledger.settle(Reservation("other", reservation.id, reservation.amount), Budget(0.5, 0.0))
    with pytest.raises(ValueError, match="ledger recorded"):
        ledger.settle(Reservation("ctx", reservation.id, Budget(5.0, 1e-6)), Budget(4.0, 0.0))
    assert _rows(ledger) == before
    ledger.settle(reservation, Budget(1.0, 1e-6))  # exactly the reserved amount is fine
    before = _rows(ledger)
    with pytest.raises(ValueError, match="already settled"):
        ledger.settle(reservation, Budget(0.5, 0.0))
    assert _rows(ledger) == before
    assert ledger.status("ctx", TOTAL).spent == Budget(1.0, 1e-6)


def test_inputs_are_validated(ledger):
    with pytest.raises(ValueError, match=r"amount\.epsilon must be a finite number >= 0"):
        ledger.reserve("ctx", TOTAL, Budget(-1.0, 0.0))
    with pytest.raises(ValueError, match=r"amount\.delta"):
        ledger.reserve("ctx", TOTAL, Budget(1.0, 1.5))
    with pytest.raises(ValueError, match=r"total\.epsilon must be > 0"):
        ledger.reserve("ctx", Budget(0.0, 0.0), Budget(0.0, 0.0))
    with pytest.raises(ValueError, match=r"total\.epsilon must be finite"):
        ledger.status("ctx", Budget(float("inf"), 0.0))
    with pytest.raises(ValueError, match="non-empty string"):
        ledger.reserve("", TOTAL, Budget(1.0, 0.0))
    assert _rows(ledger) == []  # nothing recorded
    free = ledger.reserve("ctx", TOTAL, Budget(0, 0.0))  # a query that releases nothing
    with pytest.raises(ValueError, match=r"actual\.epsilon"):
        ledger.settle(free, Budget(float("nan"), 0.0))


def test_status_of_an_empty_ledger(ledger):
    status = ledger.status("ctx", TOTAL)
    assert status.spent == Budget(0.0, 0.0) and status.remaining == TOTAL and status.queries == 0


def test_entries_hold_keyed_labels_and_the_file_is_private(key, tmp_path):
    ledger = QueryLedger(key, tmp_path / "ledger" / "ledger.sqlite")
    reservation = ledger.reserve("secret-context", TOTAL, Budget(1.0, 0.0))
    ledger.settle(reservation, Budget(0.5, 0.0))
    ledger.store.close()  # checkpoints the write-ahead log into the file
    path = tmp_path / "ledger" / "ledger.sqlite"
    assert b"secret" not in path.read_bytes()
    (row,) = _rows(QueryLedger(key, path))
    assert row["context"] == key.label("query-ledger/context", "secret-context")
    assert row["key"] == key.label("query-ledger/key") and row["client"] == ""
    assert row["id"] == reservation.id and len(reservation.id) == 32
    assert (row["epsilon"], row["settled_epsilon"]) == (1.0, 0.5) and row["settled_at"] > 0
    for name in os.listdir(path.parent):  # the database and its -wal/-shm files
        assert stat.S_IMODE(os.stat(path.parent / name).st_mode) == 0o600, name
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


def test_a_lost_key_is_refused_instead_of_resetting_every_budget(tmp_path, ledger_location):
    """Before: the recreated key's ledger ignored the old entries and granted the whole total again."""
    key_path, path = tmp_path / "noise.key", ledger_location
    old = QueryLedger(NoiseKey(key_path), path)
    old.settle(old.reserve("ctx", TOTAL, Budget(2.0, 0.0)), Budget(1.0, 0.0))
    key_path.unlink()  # lost: the next start creates a new key
    new = QueryLedger(NoiseKey(key_path), path)
    before = _rows(new)
    for call in (new.check_key, lambda: new.reserve("ctx", TOTAL, Budget(3.0, 0.0))):
        with pytest.raises(ForeignEntries) as info:
            call()
        message = str(info.value)
        assert info.value.count == 1 and f"query ledger {new.location} holds 1 entries" in message
        assert str(key_path) in message and "lost or replaced" in message
        assert "restart at zero" in message and "`aggregate.allow_foreign_ledger: true`" in message
    assert _rows(new) == before  # nothing written
    status = new.status("ctx", TOTAL)  # reports still read it, and say what they cannot match
    assert status.spent == Budget(0.0, 0.0) and status.queries == 0 and status.foreign == 1
    assert status.to_json()["entries_under_other_keys"] == 1
    assert QueryLedger(NoiseKey(tmp_path / "absent" / "k"), tmp_path / "absent" / "q.sqlite").check_key() == 0


def test_entries_under_another_key_are_ignored_and_counted_when_allowed(tmp_path, ledger_location):
    path = ledger_location
    old = QueryLedger(NoiseKey(tmp_path / "old.key"), path)
    old.settle(old.reserve("ctx", TOTAL, Budget(2.0, 0.0)), Budget(1.0, 0.0))
    new = QueryLedger(NoiseKey(tmp_path / "new.key"), path, allow_foreign=True)
    assert new.check_key() == 1
    new.reserve("ctx", TOTAL, Budget(3.0, 0.0))  # the old key's spending does not count here
    assert new.status("ctx", TOTAL).queries == 1 and new.status("ctx", TOTAL).foreign == 1
    old_again = QueryLedger(NoiseKey(tmp_path / "old.key"), path)
    assert old_again.status("ctx", TOTAL).spent == Budget(1.0, 0.0)  # nor the new key's there
    with pytest.raises(ForeignEntries):  # the old key now sees the new key's entry
        old_again.reserve("ctx", TOTAL, Budget(0.5, 0.0))


def _reserve_many(key_path, ledger_path, count, queue):
    ledger = QueryLedger(NoiseKey(key_path), ledger_path)
    granted = 0
    for _ in range(count):
        try:
            ledger.reserve("shared", Budget(25.0, 0.0), Budget(1.0, 0.0))
            granted += 1
        except BudgetExhausted:
            pass
    queue.put(granted)


def test_concurrent_processes_never_overspend(tmp_path, ledger_location):
    key_path, ledger_path = tmp_path / "noise.key", ledger_location
    NoiseKey(key_path)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_reserve_many, args=(key_path, ledger_path, 10, queue)) for _ in range(4)]
    for proc in procs:
        proc.start()
    granted = [queue.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert sum(granted) == 25
    status = QueryLedger(NoiseKey(key_path), ledger_path).status("shared", Budget(25.0, 0.0))
    assert status.spent == Budget(25.0, 0.0) and status.queries == 25 and status.remaining == Budget(0.0, 0.0)


def test_running_totals_are_the_exact_sums_of_the_reservations(key, ledger_location):
    rng = np.random.default_rng(0)
    path = ledger_location
    writers = [QueryLedger(key, path) for _ in range(3)]
    amounts = []
    for i in range(120):
        ledger = writers[i % 3]
        reserved = Budget(float(rng.uniform(0, 0.01)), float(rng.uniform(0, 1e-8)))
        reservation = ledger.reserve("ctx", Budget(10.0, 1e-5), reserved)
        if i % 4:
            actual = Budget(reserved.epsilon * float(rng.uniform()), 0.0)
            ledger.settle(reservation, actual)
            amounts.append(actual)
        else:
            amounts.append(reserved)  # unsettled: counts in full
    expected = Budget(math.fsum(a.epsilon for a in amounts), math.fsum(a.delta for a in amounts))
    for ledger in [*writers, QueryLedger(key, path)]:  # double-double sums: the correctly rounded sum
        assert ledger.status("ctx", Budget(10.0, 1e-5)).spent == expected


def test_threads_sharing_one_ledger_never_overspend(ledger):
    granted = []

    def worker():
        for _ in range(10):
            try:
                ledger.reserve("shared", Budget(25.0, 0.0), Budget(1.0, 0.0))
                granted.append(1)
            except BudgetExhausted:
                pass

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(granted) == 25 and len(_rows(ledger)) == 25
    assert ledger.status("shared", Budget(25.0, 0.0)).spent == Budget(25.0, 0.0)


# --- client quotas (aggregate.clients) ------------------------------------------------------------
ALICE, BOB = Quota("alice", 0.25), Quota("bob", 1.0)


def _approx(budget: Budget):
    return Budget(pytest.approx(budget.epsilon, rel=1e-12, abs=0), pytest.approx(budget.delta, rel=1e-12, abs=0))


def test_a_client_spends_at_most_its_share_and_the_context_caps_every_client(ledger, key, ledger_location):
    first = ledger.reserve("ctx", TOTAL, Budget(0.5, 1e-6), ALICE)
    assert first.quota == ALICE
    with pytest.raises(BudgetExhausted, match="client 'alice' \\(share 0.25\\) on context 'ctx'") as info:
        ledger.reserve("ctx", TOTAL, Budget(0.5, 0.0), ALICE)  # 1.0 > 0.25 x 3
    assert info.value.quota == ALICE and info.value.total == Budget(0.75, 2.5e-6)
    assert info.value.remaining == _approx(Budget(0.25, 1.5e-6))
    assert len(_rows(ledger)) == 1  # nothing written
    second = ledger.reserve("ctx", TOTAL, Budget(0.25, 0.0), ALICE)  # exactly its share
    assert ledger.status("ctx", TOTAL, ALICE).remaining == _approx(Budget(0.0, 1.5e-6))
    # bob's share is the whole total, but alice's spending counts against the context's
    ledger.reserve("ctx", TOTAL, Budget(2.0, 0.0), BOB)
    with pytest.raises(BudgetExhausted, match="context 'ctx' exhausted") as info:
        ledger.reserve("ctx", TOTAL, Budget(0.5, 0.0), BOB)
    assert info.value.quota is None and info.value.remaining == _approx(Budget(0.25, 9e-6))
    assert ledger.status("ctx", TOTAL, BOB).remaining == _approx(Budget(0.25, 9e-6))  # the context's, smaller
    # settling gives the client its difference back, and returns its status
    status = ledger.settle(first, Budget(0.125, 0.0))
    assert status.client == "alice" and status.total == Budget(0.75, 2.5e-6)
    assert status.spent == Budget(0.375, 0.0) and status.queries == 2
    assert status.remaining == _approx(Budget(0.375, 2.5e-6))
    assert status.to_json()["client"] == "alice"
    whole = ledger.status("ctx", TOTAL)
    assert whole.spent == Budget(2.375, 0.0) and whole.queries == 3 and whole.client is None
    assert "client" not in whole.to_json()
    assert ledger.status("other", TOTAL, ALICE).spent == Budget(0.0, 0.0)  # per context
    # the store names clients by keyed label only; another ledger object reads the same totals
    assert {row["client"] for row in _rows(ledger)} == {key.label("query-ledger/client", "alice"),
                                                        key.label("query-ledger/client", "bob")}
    fresh = QueryLedger(key, ledger_location)
    assert fresh.status("ctx", TOTAL, ALICE) == ledger.status("ctx", TOTAL, ALICE)
    # a reservation is settled under the client it was made for
    with pytest.raises(ValueError, match="not in ledger"):
        ledger.settle(Reservation("ctx", second.id, second.amount, BOB), Budget(0.1, 0.0))
    with pytest.raises(ValueError, match="not in ledger"):
        ledger.settle(Reservation("ctx", second.id, second.amount), Budget(0.1, 0.0))


def test_quotas_are_validated():
    for share in (0, 1.5, True, "1"):
        with pytest.raises(ValueError, match="share must lie in"):
            Quota("alice", share)
    with pytest.raises(ValueError, match="non-empty string"):
        Quota("", 0.5)


# --- a store that cannot be written: refused, nothing recorded (HTTP 503 in serving) ---------------
def test_a_full_disk_refuses_the_reservation_and_records_nothing(key, tmp_path):
    path = tmp_path / "ledger.sqlite"
    ledger = QueryLedger(key, path)
    ledger.reserve("ctx", TOTAL, Budget(0.5, 0.0))
    pages = ledger.store._conn.execute("PRAGMA page_count").fetchone()[0]
    ledger.store._conn.execute(f"PRAGMA max_page_count = {pages}")  # SQLite's own "disk is full"
    with pytest.raises(LedgerUnavailable, match="full"):
        for _ in range(500):  # until the next page is needed
            ledger.reserve("ctx", Budget(1e6, 0.0), Budget(1e-3, 0.0))
    written = len(_rows(ledger))
    ledger.store._conn.execute("PRAGMA max_page_count = 1073741823")
    assert len(_rows(QueryLedger(key, path))) == written  # the refused one left nothing behind
    ledger.reserve("ctx", Budget(1e6, 0.0), Budget(1e-3, 0.0))  # space again: it works


def test_a_read_only_store_refuses_reservations_and_still_reports(key, tmp_path):
    path = tmp_path / "ledger.sqlite"
    QueryLedger(key, path).reserve("ctx", TOTAL, Budget(1.0, 0.0))
    read_only = QueryLedger(key, _read_only(path))
    with pytest.raises(LedgerUnavailable, match="readonly"):
        read_only.reserve("ctx", TOTAL, Budget(0.5, 0.0))
    assert read_only.status("ctx", TOTAL).spent == Budget(1.0, 0.0)


def _read_only(path):
    """The store at ``path``, its connection reopened read-only (a file the server cannot write)."""
    store = open_store(path)
    store._conn.close()
    store._conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None,
                                  check_same_thread=False)
    return store


def test_only_the_settlement_skips_the_wait_for_the_disk(key, tmp_path, monkeypatch):
    """A reservation is durable before it returns (synchronous=FULL); a settlement, which only
    gives budget back, commits with synchronous=NORMAL, and the connection is FULL again after."""
    ledger = QueryLedger(key, tmp_path / "ledger.sqlite")
    conn = ledger.store._conn
    seen = []
    conn.set_trace_callback(lambda sql: seen.append(sql) if sql.startswith(("PRAGMA synchronous", "COMMIT")) else None)
    reservation = ledger.reserve("ctx", TOTAL, Budget(1.0, 0.0))
    assert seen == ["COMMIT"]
    seen.clear()
    ledger.settle(reservation, Budget(0.5, 0.0))
    assert seen == ["PRAGMA synchronous = NORMAL", "COMMIT", "PRAGMA synchronous = FULL"]
    assert conn.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
    assert ledger.status("ctx", TOTAL).spent == Budget(0.5, 0.0)
