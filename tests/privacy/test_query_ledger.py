"""The query ledger: reserve-before-compute, settle, refusal at the total, persistence across
restarts, crash safety, keyed entries only, no over-spending under concurrent processes and
threads, and running totals that parse only what other writers appended (exact sums; a replaced,
shortened or rewritten file is read again)."""

import json
import math
import multiprocessing
import os
import stat
import threading

import numpy as np
import pytest

from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.keyed_noise import ForeignEntries, NoiseKey
from vllm_dp_plugin.privacy.query_ledger import (
    BudgetExhausted,
    BudgetStatus,
    QueryLedger,
    Quota,
    Reservation,
)

TOTAL = Budget(3.0, 1e-5)


@pytest.fixture
def key(tmp_path):
    return NoiseKey(tmp_path / "noise.key")


@pytest.fixture
def ledger(key, tmp_path):
    return QueryLedger(key, tmp_path / "ledger" / "queries.jsonl")


def _lines(ledger):
    return [json.loads(line) for line in ledger.path.read_text().splitlines()]


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
    size = ledger.path.stat().st_size
    with pytest.raises(BudgetExhausted, match="'ctx'") as info:
        ledger.reserve("ctx", TOTAL, Budget(1.5, 0.0))
    assert info.value.remaining == Budget(1.0, 1e-5)
    assert info.value.requested == Budget(1.5, 0.0)
    assert "remaining" in str(info.value) and "requested" in str(info.value)
    assert ledger.path.stat().st_size == size
    # delta alone can exhaust it too
    with pytest.raises(BudgetExhausted):
        ledger.reserve("ctx", TOTAL, Budget(0.1, 2e-5))
    assert ledger.path.stat().st_size == size
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


def test_state_persists_across_restarts(key, tmp_path):
    path = tmp_path / "queries.jsonl"
    reservation = QueryLedger(key, path).reserve("ctx", TOTAL, Budget(2.0, 0.0))
    restarted = QueryLedger(NoiseKey(tmp_path / "noise.key"), path)
    assert restarted.status("ctx", TOTAL).spent == Budget(2.0, 0.0)
    # a reservation made before the restart can be settled after it
    assert restarted.settle(reservation, Budget(1.0, 0.0)).spent == Budget(1.0, 0.0)
    assert QueryLedger(key, path).status("ctx", TOTAL).remaining == Budget(2.0, 1e-5)
    with pytest.raises(BudgetExhausted):
        QueryLedger(key, path).reserve("ctx", TOTAL, Budget(2.5, 0.0))


def test_a_crash_after_reserve_counts_the_full_reservation(key, tmp_path):
    path = tmp_path / "queries.jsonl"
    crashed = QueryLedger(key, path)
    crashed.reserve("ctx", TOTAL, Budget(2.5, 1e-6))
    del crashed  # the query died before settling
    status = QueryLedger(key, path).status("ctx", TOTAL)
    assert status.spent == Budget(2.5, 1e-6) and status.queries == 1
    with pytest.raises(BudgetExhausted):
        QueryLedger(key, path).reserve("ctx", TOTAL, Budget(1.0, 0.0))


def test_a_write_torn_by_a_crash_is_ignored_and_cut_off(ledger):
    ledger.reserve("ctx", TOTAL, Budget(1.0, 0.0))
    with open(ledger.path, "ab") as handle:
        handle.write(b'{"context":"abc","del')  # a crash mid-write: reserve() never returned
    assert ledger.status("ctx", TOTAL).spent == Budget(1.0, 0.0)
    ledger.reserve("ctx", TOTAL, Budget(1.0, 0.0))
    assert len(_lines(ledger)) == 2  # the torn bytes are gone, every line parses
    assert ledger.status("ctx", TOTAL).spent == Budget(2.0, 0.0)


def test_bad_settlements_are_refused(ledger):
    reservation = ledger.reserve("ctx", TOTAL, Budget(1.0, 1e-6))
    size = ledger.path.stat().st_size
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
    assert ledger.path.stat().st_size == size
    ledger.settle(reservation, Budget(1.0, 1e-6))  # exactly the reserved amount is fine
    size = ledger.path.stat().st_size
    with pytest.raises(ValueError, match="already settled"):
        ledger.settle(reservation, Budget(0.5, 0.0))
    assert ledger.path.stat().st_size == size
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
    assert not ledger.path.exists()  # nothing recorded, nothing created
    free = ledger.reserve("ctx", TOTAL, Budget(0, 0.0))  # a query that releases nothing
    with pytest.raises(ValueError, match=r"actual\.epsilon"):
        ledger.settle(free, Budget(float("nan"), 0.0))


def test_status_of_a_missing_ledger_creates_nothing(ledger):
    status = ledger.status("ctx", TOTAL)
    assert status.spent == Budget(0.0, 0.0) and status.remaining == TOTAL and status.queries == 0
    assert not ledger.path.exists()


def test_entries_hold_keyed_labels_and_the_file_is_private(key, ledger):
    reservation = ledger.reserve("secret-context", TOTAL, Budget(1.0, 0.0))
    ledger.settle(reservation, Budget(0.5, 0.0))
    text = ledger.path.read_text()
    assert "secret" not in text
    reserve, settle = _lines(ledger)
    assert reserve["context"] == settle["context"] == key.label("query-ledger/context", "secret-context")
    assert reserve["key"] == settle["key"] == key.label("query-ledger/key")
    assert (reserve["kind"], settle["kind"]) == ("reserve", "settle")
    assert reserve["id"] == settle["id"] == reservation.id and len(reservation.id) == 32
    assert (reserve["epsilon"], settle["epsilon"]) == (1.0, 0.5)
    assert reserve["time"] > 0
    assert stat.S_IMODE(os.stat(ledger.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(ledger.path.parent).st_mode) == 0o700


def test_a_lost_key_is_refused_instead_of_resetting_every_budget(tmp_path):
    """Before: the recreated key's ledger ignored the old lines and granted the whole total again."""
    key_path, path = tmp_path / "noise.key", tmp_path / "queries.jsonl"
    old = QueryLedger(NoiseKey(key_path), path)
    old.settle(old.reserve("ctx", TOTAL, Budget(2.0, 0.0)), Budget(1.0, 0.0))
    key_path.unlink()  # lost: the next start creates a new key
    new = QueryLedger(NoiseKey(key_path), path)
    size = path.stat().st_size
    for call in (new.check_key, lambda: new.reserve("ctx", TOTAL, Budget(3.0, 0.0))):
        with pytest.raises(ForeignEntries) as info:
            call()
        message = str(info.value)
        assert info.value.count == 2 and f"query ledger {path} holds 2 entries" in message
        assert str(key_path) in message and "lost or replaced" in message
        assert "restart at zero" in message and "`aggregate.allow_foreign_ledger: true`" in message
    assert path.stat().st_size == size  # nothing written
    status = new.status("ctx", TOTAL)  # reports still read it, and say what they cannot match
    assert status.spent == Budget(0.0, 0.0) and status.queries == 0 and status.foreign == 2
    assert status.to_json()["entries_under_other_keys"] == 2
    assert QueryLedger(NoiseKey(tmp_path / "absent" / "k"), tmp_path / "absent" / "q.jsonl").check_key() == 0


def test_entries_under_another_key_are_ignored_and_counted_when_allowed(tmp_path):
    path = tmp_path / "queries.jsonl"
    old = QueryLedger(NoiseKey(tmp_path / "old.key"), path)
    old.settle(old.reserve("ctx", TOTAL, Budget(2.0, 0.0)), Budget(1.0, 0.0))
    new = QueryLedger(NoiseKey(tmp_path / "new.key"), path, allow_foreign=True)
    assert new.check_key() == 2
    new.reserve("ctx", TOTAL, Budget(3.0, 0.0))  # the old key's spending does not count here
    assert new.status("ctx", TOTAL).queries == 1 and new.status("ctx", TOTAL).foreign == 2
    old_again = QueryLedger(NoiseKey(tmp_path / "old.key"), path)
    assert old_again.status("ctx", TOTAL).spent == Budget(1.0, 0.0)  # nor the new key's there
    with pytest.raises(ForeignEntries):  # the old key now sees the new key's line
        old_again.reserve("ctx", TOTAL, Budget(0.5, 0.0))


def test_corrupt_lines_are_a_clear_error(ledger):
    ledger.reserve("ctx", TOTAL, Budget(1.0, 0.0))
    good = ledger.path.read_text()
    ledger.path.write_text(good + "{not json\n" + good)
    with pytest.raises(ValueError, match=r"queries\.jsonl line 2 is corrupt"):
        ledger.status("ctx", TOTAL)
    with pytest.raises(ValueError, match="line 2 is corrupt"):
        ledger.reserve("ctx", TOTAL, Budget(0.1, 0.0))
    entry = json.loads(good)
    entry["epsilon"] = -1.0
    ledger.path.write_text(good + json.dumps(entry) + "\n")
    with pytest.raises(ValueError, match="line 2 is corrupt: epsilon"):
        ledger.status("ctx", TOTAL)
    ledger.path.write_text(good + good)  # a reservation id twice
    with pytest.raises(ValueError, match="line 2 repeats reservation id"):
        ledger.status("ctx", TOTAL)


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


def test_concurrent_processes_never_overspend(tmp_path):
    key_path, ledger_path = tmp_path / "noise.key", tmp_path / "queries.jsonl"
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
    assert len(ledger_path.read_text().splitlines()) == 25
    status = QueryLedger(NoiseKey(key_path), ledger_path).status("shared", Budget(25.0, 0.0))
    assert status.spent == Budget(25.0, 0.0) and status.queries == 25 and status.remaining == Budget(0.0, 0.0)


# --- running totals: only what was appended since the last read is parsed -------------------------
def _count_parses(monkeypatch):
    from vllm_dp_plugin.privacy import query_ledger

    calls = []
    real = query_ledger._parse
    monkeypatch.setattr(query_ledger, "_parse", lambda raw: calls.append(raw) or real(raw))
    return calls


def test_a_reserve_parses_only_the_lines_other_writers_appended(key, tmp_path, monkeypatch):
    path = tmp_path / "queries.jsonl"
    mine, other = QueryLedger(key, path), QueryLedger(key, path)
    for _ in range(50):
        mine.settle(mine.reserve("ctx", TOTAL, Budget(0.01, 0.0)), Budget(0.005, 0.0))
    calls = _count_parses(monkeypatch)
    mine.reserve("ctx", TOTAL, Budget(0.01, 0.0))
    assert calls == []  # its own lines are applied as written: nothing re-read
    other.settle(other.reserve("ctx", TOTAL, Budget(0.02, 1e-7)), Budget(0.01, 0.0))  # parses 101 once
    assert len(calls) == 101
    calls.clear()
    status = mine.status("ctx", TOTAL)
    assert len(calls) == 2  # the other writer's two lines
    assert status.queries == 52
    assert status.spent == Budget(math.fsum([0.005] * 50 + [0.01, 0.01]), 0.0)
    assert other.status("ctx", TOTAL) == status


def test_running_totals_are_the_exact_sums_of_the_file(key, tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "queries.jsonl"
    writers = [QueryLedger(key, path) for _ in range(3)]
    amounts = []
    for i in range(300):
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
    for ledger in [*writers, QueryLedger(key, path)]:
        assert ledger.status("ctx", Budget(10.0, 1e-5)).spent == expected  # bit for bit


def test_a_replaced_or_shortened_file_is_read_again(key, tmp_path):
    path = tmp_path / "queries.jsonl"
    ledger = QueryLedger(key, path)
    ledger.reserve("ctx", TOTAL, Budget(1.0, 0.0))
    first = path.read_bytes()
    ledger.reserve("ctx", TOTAL, Budget(0.5, 0.0))
    assert ledger.status("ctx", TOTAL).spent == Budget(1.5, 0.0)
    path.write_bytes(first)  # same inode, shorter
    assert ledger.status("ctx", TOTAL).spent == Budget(1.0, 0.0)
    replacement = tmp_path / "new.jsonl"
    QueryLedger(key, replacement).reserve("ctx", TOTAL, Budget(0.25, 0.0))
    os.replace(replacement, path)  # another file
    status = ledger.status("ctx", TOTAL)
    assert status.spent == Budget(0.25, 0.0) and status.queries == 1
    # rewritten in place, same size, its last line changed: read again
    path.write_bytes(path.read_bytes().replace(b'"epsilon":0.25', b'"epsilon":0.75'))
    assert ledger.status("ctx", TOTAL).spent == Budget(0.75, 0.0)
    path.unlink()
    assert ledger.status("ctx", TOTAL).spent == Budget(0.0, 0.0)
    ledger.reserve("ctx", TOTAL, Budget(2.0, 0.0))  # a new file from scratch
    assert ledger.status("ctx", TOTAL).spent == Budget(2.0, 0.0) and len(_lines(ledger)) == 1


def test_an_entry_missing_its_newline_is_counted_once_when_another_writer_ends_it(key, tmp_path):
    path = tmp_path / "queries.jsonl"
    reader, writer = QueryLedger(key, path), QueryLedger(key, path)
    reader.reserve("ctx", TOTAL, Budget(1.0, 0.0))
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # a crash between the line and its newline
    assert reader.status("ctx", TOTAL).spent == Budget(1.0, 0.0)
    writer.reserve("ctx", TOTAL, Budget(0.5, 0.0))  # writes the missing newline first
    assert path.read_bytes().count(b"\n") == 2 and len(_lines(reader)) == 2
    assert reader.status("ctx", TOTAL).spent == Budget(1.5, 0.0) and reader.status("ctx", TOTAL).queries == 2
    path.write_bytes(path.read_bytes() + b'{"torn')  # a torn write after it: ignored, then cut off
    assert reader.status("ctx", TOTAL).spent == Budget(1.5, 0.0)
    reader.reserve("ctx", TOTAL, Budget(0.25, 0.0))
    assert len(_lines(reader)) == 3 and writer.status("ctx", TOTAL).spent == Budget(1.75, 0.0)


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
    assert len(granted) == 25 and len(_lines(ledger)) == 25
    assert ledger.status("shared", Budget(25.0, 0.0)).spent == Budget(25.0, 0.0)


# --- client quotas (aggregate.clients) ------------------------------------------------------------
ALICE, BOB = Quota("alice", 0.25), Quota("bob", 1.0)


def _approx(budget: Budget):
    return Budget(pytest.approx(budget.epsilon, rel=1e-12, abs=0), pytest.approx(budget.delta, rel=1e-12, abs=0))


def test_a_client_spends_at_most_its_share_and_the_context_caps_every_client(ledger, key):
    first = ledger.reserve("ctx", TOTAL, Budget(0.5, 1e-6), ALICE)
    assert first.quota == ALICE
    with pytest.raises(BudgetExhausted, match="client 'alice' \\(share 0.25\\) on context 'ctx'") as info:
        ledger.reserve("ctx", TOTAL, Budget(0.5, 0.0), ALICE)  # 1.0 > 0.25 x 3
    assert info.value.quota == ALICE and info.value.total == Budget(0.75, 2.5e-6)
    assert info.value.remaining == _approx(Budget(0.25, 1.5e-6))
    assert len(_lines(ledger)) == 1  # nothing written
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
    # the file names clients by keyed label only; another ledger object reads the same totals
    text = ledger.path.read_text()
    assert "alice" not in text and "bob" not in text
    assert {line["client"] for line in _lines(ledger)} == {key.label("query-ledger/client", "alice"),
                                                          key.label("query-ledger/client", "bob")}
    fresh = QueryLedger(key, ledger.path)
    assert fresh.status("ctx", TOTAL, ALICE) == ledger.status("ctx", TOTAL, ALICE)
    # a reservation is settled under the client it was made for
    with pytest.raises(ValueError, match="not in ledger"):
        ledger.settle(Reservation("ctx", second.id, second.amount, BOB), Budget(0.1, 0.0))
    with pytest.raises(ValueError, match="not in ledger"):
        ledger.settle(Reservation("ctx", second.id, second.amount), Budget(0.1, 0.0))


def test_lines_written_before_quotas_still_count(ledger):
    reservation = ledger.reserve("ctx", TOTAL, Budget(1.0, 0.0))
    lines = _lines(ledger)
    del lines[0]["client"]  # a ledger written before client quotas
    ledger.path.write_text(json.dumps(lines[0]) + "\n")
    fresh = QueryLedger(NoiseKey(ledger.path.parent.parent / "noise.key"), ledger.path)
    assert fresh.status("ctx", TOTAL).spent == Budget(1.0, 0.0)
    assert fresh.settle(reservation, Budget(0.5, 0.0)).spent == Budget(0.5, 0.0)


def test_quotas_are_validated():
    for share in (0, 1.5, True, "1"):
        with pytest.raises(ValueError, match="share must lie in"):
            Quota("alice", share)
    with pytest.raises(ValueError, match="non-empty string"):
        Quota("", 0.5)
