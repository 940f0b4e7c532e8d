"""``python -m benchmarks.context_speed``: the option checks that run before any server starts,
and the stems its three measurements write under."""

from __future__ import annotations

import pytest

from benchmarks import context_speed
from vllm_dp_plugin.benchmarks.lib.cli import today


@pytest.mark.parametrize("argv", [["--rows", "full"], ["--rows", "aggregate_vote"],
                                  ["--sweep", "1,4", "--rows", "aggregate_answer,aggregate_extract"],
                                  ["--sweep", "1,4"]])
def test_bad_row_choices_stop_before_anything_starts(argv, monkeypatch):
    monkeypatch.setattr(context_speed, "ensure_model", lambda m: pytest.fail("started"))
    with pytest.raises(SystemExit, match="--rows|--sweep"):
        context_speed.main(argv)


def test_each_measurement_writes_its_stem(tmp_path, monkeypatch):
    monkeypatch.setattr(context_speed, "ensure_model", lambda m: m)
    monkeypatch.setattr(context_speed, "answer_speed", lambda *a, **k: [])
    monkeypatch.setattr(context_speed, "answer_sweep", lambda *a, **k: [])
    monkeypatch.setattr(context_speed, "speed", lambda *a, **k: [
        {"setting": "stock", "s_per_token": 0.1, "ratio_to_stock": 1.0, "tokens": 10}])
    monkeypatch.setattr(context_speed, "device_label", lambda d: "cpu-test")
    common = ["--out", str(tmp_path), "--model", "m"]
    for argv in (["--rows", "aggregate_extract"], ["--sweep", "1,4", "--rows", "full,aggregate_answer"], []):
        assert context_speed.main([*argv, *common]) == 0
    suffix = f"-cpu-test-{today()}.md"
    assert sorted(p.name.removesuffix(suffix) for p in tmp_path.glob("*.md")) == [
        "context-answer-sweep-full-aggregate_answer", "context-extract-speed", "context-speed"]
