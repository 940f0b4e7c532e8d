"""The ledger suite: its bulk fill is the history the ledger itself would record (same totals,
queries and key entries), the JSONL baseline loads from git, and a small run writes its table."""

import json

import pytest

from benchmarks import ledger_jsonl
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


def test_a_small_run_writes_its_table_and_the_jsonl_baseline_counts_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "OPENERS", {})  # the research suite registers the JSONL ledger
    assert ledger_jsonl.main(["--entries", "40", "--pairs", "3", "--backends", "sqlite,sqlite-normal,jsonl",
                              "--out", str(tmp_path), "--date", "d", "--work", str(tmp_path)]) == 0
    (found,) = tmp_path.glob("ledger-*-d.json")
    result = json.loads(found.read_text())
    assert {r["backend"] for r in result["rows"]} == {"sqlite", "sqlite-normal", "jsonl"}
    assert all(r["queries_before"] == 20 and r["pair_ms_median"] > 0 for r in result["rows"])
    assert "| sqlite | 40 |" in found.with_suffix(".md").read_text()
    assert "Command: `python -m benchmarks.ledger_jsonl --entries 40" in found.with_suffix(".md").read_text()


def test_the_installed_suite_needs_no_checkout(tmp_path, monkeypatch):
    """The JSONL baseline (``git show`` of an old revision) is the repository's research suite: the
    installed one neither runs it by default nor accepts it, so it works outside a checkout."""
    monkeypatch.setattr(bench, "OPENERS", {})
    assert bench.build_parser().parse_args([]).backends == bench.BACKENDS == ("sqlite", "sqlite-normal", "postgresql")
    with pytest.raises(SystemExit, match="unknown"):
        bench.main(["--backends", "jsonl", "--out", str(tmp_path)])
    monkeypatch.chdir(tmp_path)  # not a git checkout
    assert bench.main(["--entries", "20", "--pairs", "2", "--backends", "sqlite", "--out", str(tmp_path),
                       "--date", "d", "--work", str(tmp_path)]) == 0
    assert "Command: `vllm-dp bench ledger --entries 20" in next(tmp_path.glob("ledger-*-d.md")).read_text()
