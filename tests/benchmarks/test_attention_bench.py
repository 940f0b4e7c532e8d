"""`python -m benchmarks.attention --quick`: runs end to end, writes every result file with its key rows."""

import csv
import json
import math

import pytest
import torch

from benchmarks.attention import experiments, main, report
from benchmarks.attention.settings import Settings, TreePlan
from vllm_dp_plugin.attention.core import DPCrossAttention
from vllm_dp_plugin.attention.mapping import HeadMapping

DATE = "2026-11-22"
STEM = f"attention-cpu-{DATE}"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = main(["--quick", "--out", str(out), "--no-progress", "--date", DATE])
    return rc, out


def test_quick_run_writes_every_result_file(quick_run):
    rc, out = quick_run
    assert rc == 0
    for suffix in (".md", ".json", "-accuracy.csv", "-sources.csv", "-speed.csv", "-real-heads.csv"):
        path = out / f"{STEM}{suffix}"
        assert path.is_file() and path.stat().st_size > 0, path
    for plot in ("-error-vs-n.png", "-error-vs-eps.png"):
        assert (out / f"{STEM}{plot}").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_has_the_sections_targets_and_rows(quick_run):
    text = (quick_run[1] / f"{STEM}.md").read_text()
    for needle in (
        "## Targets",
        "## 1. Accuracy, in-regime synthetic data",
        "## 2. Real heads",
        "## 3. Speed and memory",
        "one exact attention pass = SDPA prefill",
        "Command: `python -m benchmarks.attention --quick",
        f"torch {torch.__version__}",
        "| state | 16 | 512 | 1 | 2 |",
        "| tree | 16 | 2048 | 16 |",
        "| 0 | state/taylor s=2 |",
    ):
        assert needle in text, needle
    # the full-size targets are not measured by --quick and must say so (not PASS/FAIL)
    assert text.count("(not measured in this run)") == 4


def test_json_and_csv_hold_the_raw_numbers(quick_run):
    out = quick_run[1]
    results = json.loads((out / f"{STEM}.json").read_text())
    records = {(r["mode"], r["d"], r["n"], r["eps"]): r for r in results["accuracy"]["records"]}
    state = records[("state", 16, 2048, 16.0)]
    assert state["status"] == "ok" and state["seeds"] == 2
    assert 0 < state["rel_median"] < 0.1 and state["cos_median"] > 0.99  # in regime, large eps
    assert state["den_nonpos_frac"] == 0
    # more context, less noise: the state's noise error falls roughly like 1/n
    slope = next(s for s in results["accuracy"]["slopes"] if (s["mode"], s["eps"]) == ("state", 1.0))
    assert -1.4 < slope["noise_slope"] < -0.6
    sources = {(s["mode"], s["n"]): s for s in results["accuracy"]["sources"]}
    assert sources[("state", 512)]["clip_rel_median"] == 0  # paper setting: nothing is clipped
    assert sources[("state", 512)]["kernel_rel_median"] < 0.1
    if experiments.tree_release_class() is not None:
        assert records[("tree", 16, 512, 1.0)]["status"] == "ok"
        assert sources[("tree", 512)]["ownleaf_rel_median"] >= 0
    speed = results["speed"]["rows"]
    assert [r["n"] for r in speed] == [512, 2048]
    assert all(r["state_query_s"] > 0 and r["exact_prefill_s"] > 0 for r in speed)
    real = results["real"]
    assert not real.get("skipped")
    assert {r["layer"] for r in real["rows"]} == {0} and all(math.isfinite(r["T"]) for r in real["rows"])
    with open(out / f"{STEM}-accuracy.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {"mode", "d", "n", "eps", "rel_median", "noise_rel_median", "den_nonpos_frac"} <= set(rows[0])


def test_render_rewrites_the_report_from_the_json(quick_run):
    out = quick_run[1]
    md = out / f"{STEM}.md"
    before = md.read_text()
    md.unlink()
    assert main(["--render", str(out / f"{STEM}.json")]) == 0
    assert md.read_text() == before


def test_served_clamp_equals_core_clamp():
    """The bench reads the pre-clamp denominator with clamp=False and clamps itself: same output."""
    k, q, v = experiments.synthetic(300, 8, 16, seed=0)
    mapping = HeadMapping.paper(8)
    settings = Settings(epsilons=(0.5,))
    outs = []
    for clamp in (True, False):
        params = experiments.make_params("state", 0.5, settings)
        params = type(params)(**{**params.__dict__, "clamp": clamp})
        att = DPCrossAttention(params, mapping, 1, 8, 8).build(k, v, torch.Generator().manual_seed(3))
        outs.append(att.query(q) if clamp else experiments.dp_answer(att, q)["out"])
    assert torch.equal(outs[0], outs[1])


def test_targets_report_pass_fail_and_unmeasured():
    results = {
        "accuracy": {"target": {"rel_median": 0.05}},
        "speed": {"rows": [{"n": 16384, "d": 64, "state_speedup": 3.0, "tree_build_over_prefill": 2.0}]},
    }
    lines = [report.target_line(t) for t in report.targets(results)]
    assert lines[0].startswith("PASS state accuracy")
    assert lines[1].startswith("FAIL state query throughput") and "n=16384" in lines[1]
    assert lines[2].startswith("n/a  state query throughput") and "n=32768" in lines[2]
    assert lines[3].startswith("PASS tree build")
    assert all(report.target_line(t).startswith("n/a") for t in report.targets({}))


def test_slope_fit_and_tree_plan():
    assert experiments.fit_slope([1e3, 4e3, 16e3], [1.0, 0.25, 0.0625]) == pytest.approx(-1.0)
    assert math.isnan(experiments.fit_slope([1e3], [1.0]))
    plan = TreePlan()
    assert plan.runs(64, 1024, (0.5, 1.0, 4.0, 16.0), 3) == ([0.5, 1.0, 4.0, 16.0], 3)
    assert plan.runs(64, 32768, (0.5, 1.0, 4.0, 16.0), 3) == ([1.0], 1)
    assert TreePlan("full").runs(128, 32768, (1.0,), 3) == ([1.0], 3)
