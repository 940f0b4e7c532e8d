"""JSONL ledgers of earlier versions imported into the store at the first start: every
reservation (settled or not) and release kept with its keyed labels, a torn last line skipped,
corrupt files refused with nothing imported, the file renamed once imported, an import repeated
after a crash harmless, and a file written again after its import refused."""

import json

import pytest

from vllm_dp_plugin.config import ConfigError, DPPrivacyConfig
from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.ledger_migration import (
    LedgerMigrationError,
    import_jsonl,
    open_ledger,
)
from vllm_dp_plugin.privacy.ledger_store import open_store
from vllm_dp_plugin.privacy.query_ledger import BudgetExhausted, QueryLedger
from vllm_dp_plugin.privacy.release_ledger import ReleaseLedger

TOTAL = Budget(3.0, 1e-5)


def _query_line(key, kind, rid, epsilon, context="ctx", client="", key_label=None) -> str:
    """A line as the JSONL query ledger wrote it."""
    return json.dumps({"key": key_label or key.label("query-ledger/key"), "kind": kind, "id": rid,
                       "context": key.label("query-ledger/context", context), "epsilon": epsilon, "delta": 1e-7,
                       "total_epsilon": TOTAL.epsilon, "total_delta": TOTAL.delta, "time": 1.0,
                       "client": client}, sort_keys=True)


def _release_line(key, subject, release) -> str:
    return json.dumps({"key": key.label("ledger/key"), "subject": key.label("ledger/subject", subject),
                       "release": key.label("ledger/release", subject, release), "epsilon": 2.0, "delta": 1e-6,
                       "unit": "a row", "time": 1.0}, sort_keys=True)


def test_both_ledgers_are_imported_once_and_renamed(key, tmp_path):
    queries = [_query_line(key, "reserve", "a", 1.0), _query_line(key, "settle", "a", 0.25),
               _query_line(key, "reserve", "b", 0.5)]  # b never settled: counts in full
    (tmp_path / "queries.jsonl").write_text("\n".join(queries) + "\n" + '{"torn')  # a crash mid-write
    (tmp_path / "releases.jsonl").write_text(_release_line(key, "s", "r") + "\n")
    store = open_ledger(None, key)
    assert store.location == str(tmp_path / "ledger.sqlite")
    ledger = QueryLedger(key, store)
    status = ledger.status("ctx", TOTAL)
    assert status.spent.epsilon == 0.75 and status.spent.delta == pytest.approx(2e-7) and status.queries == 2
    assert len(ReleaseLedger(key, store).history("s").releases) == 1
    assert not (tmp_path / "queries.jsonl").exists() and (tmp_path / "queries.jsonl.migrated").exists()
    assert (tmp_path / "releases.jsonl.migrated").exists()
    # the imported budget is enforced: 0.75 spent of 3, so 2.5 more does not fit
    with pytest.raises(BudgetExhausted):
        ledger.reserve("ctx", TOTAL, Budget(2.5, 0.0))
    # a restart imports nothing again
    assert QueryLedger(key, open_ledger(None, key)).status("ctx", TOTAL) == status


def test_a_crash_between_the_import_and_the_rename_repeats_only_the_rename(key, tmp_path):
    path = tmp_path / "queries.jsonl"
    path.write_text(_query_line(key, "reserve", "a", 1.0) + "\n")
    store = open_store(tmp_path / "ledger.sqlite")
    data = path.read_bytes()
    assert import_jsonl(store, "query", path, "aggregate.budget_file") == 1
    path.write_bytes(data)  # as if the rename had not happened
    assert import_jsonl(store, "query", path, "aggregate.budget_file") == 0
    assert QueryLedger(key, store).status("ctx", TOTAL).queries == 1
    path.write_bytes(data + (_query_line(key, "reserve", "b", 1.0) + "\n").encode())  # an older server wrote on
    with pytest.raises(LedgerMigrationError, match=r"aggregate\.budget_file: .* has been written since"):
        import_jsonl(store, "query", path, "aggregate.budget_file")
    assert QueryLedger(key, store).status("ctx", TOTAL).queries == 1


@pytest.mark.parametrize(("lines", "error"), [
    (["{not json", "{}"], "line 1 is corrupt"),
    (["RESERVE-A", "RESERVE-A"], "line 2 repeats reservation id 'a'"),
    (["SETTLE-A"], "line 1 settles reservation 'a', which is not reserved before it"),
    (["RESERVE-A", "SETTLE-A", "SETTLE-A"], "line 3 settles reservation 'a' a second time"),
    (["NEGATIVE"], "line 1 is corrupt: epsilon is not a finite number >= 0"),
])
def test_a_corrupt_file_imports_nothing(key, tmp_path, lines, error):
    named = {"RESERVE-A": _query_line(key, "reserve", "a", 1.0), "SETTLE-A": _query_line(key, "settle", "a", 0.5),
             "NEGATIVE": _query_line(key, "reserve", "a", -1.0)}
    path = tmp_path / "queries.jsonl"
    path.write_text("\n".join(named.get(line, line) for line in lines) + "\n")
    store = open_store(tmp_path / "ledger.sqlite")
    with pytest.raises(LedgerMigrationError, match=error):
        import_jsonl(store, "query", path, "aggregate.budget_file")
    assert path.exists() and QueryLedger(key, store).status("ctx", TOTAL).queries == 0


def test_entries_of_another_key_stay_foreign_and_clients_keep_their_quota(key, tmp_path):
    from vllm_dp_plugin.privacy.query_ledger import Quota

    alice = key.label("query-ledger/client", "alice")
    (tmp_path / "queries.jsonl").write_text("\n".join([
        _query_line(key, "reserve", "a", 1.0, client=alice),
        _query_line(key, "reserve", "x", 1.0, key_label="another-key"),
    ]) + "\n")
    ledger = QueryLedger(key, open_ledger(None, key), allow_foreign=True)
    assert ledger.check_key() == 1
    assert ledger.status("ctx", TOTAL, Quota("alice", 0.5)).spent.epsilon == 1.0
    assert ledger.status("ctx", TOTAL).spent.epsilon == 1.0


def test_the_config_names_the_store_and_the_files_to_import(key, tmp_path):
    old = tmp_path / "old" / "q.jsonl"
    old.parent.mkdir()
    old.write_text(_query_line(key, "reserve", "a", 1.0) + "\n")
    cfg = DPPrivacyConfig.from_dict({"key_file": str(key.path), "ledger": str(tmp_path / "db" / "l.sqlite"),
                                     "aggregate": {"contexts": {"c": "docs.jsonl"}, "budget_file": str(old)}})
    store = cfg.ledger_store(key)
    assert store.location == str(tmp_path / "db" / "l.sqlite")
    assert QueryLedger(key, store).status("ctx", TOTAL).queries == 1
    old.with_name("q.jsonl.migrated").rename(old)
    old.write_text("{broken\n{}\n")
    with pytest.raises(ConfigError, match=r"dp_privacy\.ledger: .*line 1 is corrupt"):
        DPPrivacyConfig.from_dict({"key_file": str(key.path), "ledger": str(tmp_path / "db2.sqlite"),
                                   "aggregate": {"contexts": {"c": "docs.jsonl"}, "budget_file": str(old)}}
                                  ).ledger_store(key)
    for bad in (3, ""):
        with pytest.raises(ConfigError, match=r"dp_privacy\.ledger must be a SQLite file path or a postgresql"):
            DPPrivacyConfig.from_dict({"ledger": bad})
