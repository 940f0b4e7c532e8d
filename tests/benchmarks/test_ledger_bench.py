"""The ledger suite: its bulk fill is the history the ledger itself would record (same totals,
queries and key entries), the JSONL baseline loads from git, and a small run writes its table."""

import json

from vllm_dp_plugin.benchmarks import ledger as bench
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
from vllm_dp_plugin.privacy.ledger_store import open_store
from vllm_dp_plugin.privacy.query_ledger import QueryLedger


def test_the_bulk_fill_equals_queries_reserved_and_settled_one_by_one(tmp_path):
    key = NoiseKey(tmp_path / "noise.key")
    filled = open_store(tmp_path / "filled.sqlite")
    bench.fill_store(filled, key, 7)
    one_by_one = QueryLedger(key, tmp_path / "one.sqlite")
    for _ in range(7):
        one_by_one.settle(one_by_one.reserve(bench.CONTEXT, bench.TOTAL, bench.AMOUNT), bench.SETTLED)
    status = QueryLedger(key, filled).status(bench.CONTEXT, bench.TOTAL)
    assert status == one_by_one.status(bench.CONTEXT, bench.TOTAL) and status.queries == 7
    assert QueryLedger(key, filled).check_key() == 0


def test_a_small_run_writes_its_table_and_the_jsonl_baseline_counts_the_same(tmp_path):
    assert bench.main(["--entries", "40", "--pairs", "3", "--backends", "sqlite,sqlite-normal,jsonl",
                       "--out", str(tmp_path), "--date", "d", "--work", str(tmp_path)]) == 0
    (found,) = tmp_path.glob("ledger-*-d.json")
    result = json.loads(found.read_text())
    assert {r["backend"] for r in result["rows"]} == {"sqlite", "sqlite-normal", "jsonl"}
    assert all(r["queries_before"] == 20 and r["pair_ms_median"] > 0 for r in result["rows"])
    assert "| sqlite | 40 |" in found.with_suffix(".md").read_text()
