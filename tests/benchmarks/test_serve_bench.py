"""`vllm-dp bench serve --quick`: vLLM's bench throughput runs (and steady-state engine rounds)
with the plugin off and with DP on, and the result files carry both rows and their ratio to stock."""

import json

import pytest

from vllm_dp_plugin.benchmarks import serve as bench
from vllm_dp_plugin.benchmarks.lib.vllm import config_env
from vllm_dp_plugin.cli import main


@pytest.mark.vllm
def test_quick_run_measures_stock_and_dp_state(tmp_path):
    from vllm_dp_plugin.demo import make_demo_llama

    model = make_demo_llama(tmp_path / "llama")
    out = tmp_path / "results"
    rc = main(["bench", "serve", "--quick", "--model", str(model), "--out", str(out),
               "--configs", "stock", "dp_state"])
    assert rc == 0
    (result,) = out.glob("serve-cpu-*.json")
    data = json.loads(result.read_text())
    rows = {(r["config"], r["prefix_len"]): r for r in data["throughput"]}
    assert set(rows) == {("stock", 64), ("dp_state", 64)}
    assert all(r["requests_per_s"] > 0 for r in rows.values())
    (rel,) = [r for r in data["relative"] if r["config"] == "dp_state"]
    assert rel["decode_vs_stock"] > 0
    steady = {(r["config"], r["prefix_len"]): r for r in data["steady"]}  # one engine, best round
    assert set(steady) == set(rows) and all(r["requests_per_s"] > 0 and r["cpu_s_per_request"] > 0
                                            for r in steady.values())
    assert result.with_suffix(".md").exists() and result.with_suffix(".png").exists()


def test_dp_rows_get_the_private_context_and_stock_the_plain_prefix(tmp_path):
    s = bench.Settings(model="m", out=tmp_path, prefix_lens=(64,))
    stock = bench.dataset_flags("stock", 64, s)
    dp = bench.dataset_flags("dp_state", 64, s)
    assert stock[stock.index("--prefix-repetition-prefix-len") + 1] == "64"
    assert dp[dp.index("--random-input-len") + 1] == str(s.suffix_len)
    assert config_env("stock")["VLLM_PLUGINS"] == ""
    assert "VLLM_PLUGINS" not in config_env("plugin_off")
    tree = bench.dp_config("tree", tmp_path / "c.txt", tmp_path / "cal.json", tmp_path / "k", s)
    assert tree["dp_privacy"]["attention"]["degree"] == 1
    state = bench.dp_config("state", tmp_path / "c.txt", tmp_path / "cal.json", tmp_path / "k", s)
    assert state["dp_privacy"]["attention"]["degree"] == s.degree == 2


def test_repeated_runs_report_the_median_run_and_keep_every_run():
    runs = [bench.ThroughputRow("stock", 64, rps, rps * 10, 0, 1) for rps in (3.0, 1.0, 2.0)]
    runs.append(bench.ThroughputRow("dp_state", 64, 5.0, 50.0, 0, 1))
    rows = {r.config: r for r in bench.median_rows(runs)}
    assert rows["stock"].requests_per_s == 2.0 and rows["stock"].output_tokens_per_s == 20.0
    assert rows["stock"].runs == (3.0, 1.0, 2.0) and rows["dp_state"].runs == (5.0,)


def test_verdicts_apply_the_issue_targets():
    rows = [bench.ThroughputRow("stock", 2048, 10.0, 100.0, 0, 1), bench.ThroughputRow("plugin_off", 2048, 9.8, 98.0, 0, 1),
            bench.ThroughputRow("dp_state", 2048, 7.0, 79.0, 0, 1)]
    verdicts = bench.verdicts(bench.ratios(rows))
    assert any("plugin loaded" in v and "PASS" in v for v in verdicts)
    assert any("DP state" in v and "0.790x" in v and "FAIL" in v for v in verdicts)
