"""``vllm-dp bench train`` (``benchmarks.train``): ``--quick`` end to end (every method row, files written), the
verdict helpers, and the worker isolation (an error or a timeout is a row, not a crash)."""

import json

import pytest

from vllm_dp_plugin.benchmarks import train

DATE = "2026-11-23"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    assert train.main(["--quick", "--out", str(out), "--date", DATE, "--quiet"]) == 0
    stem = out / f"train-cpu-{DATE}"
    return (
        json.loads(stem.with_name(stem.name + ".json").read_text()),
        stem.with_name(stem.name + ".md").read_text(),
        stem.with_name(stem.name + ".png"),
    )


def test_quick_run_has_every_method_row(quick):
    results, text, png = quick
    rows = {r["method"]: r for r in results["methods"]}
    assert list(rows) == list(train.METHODS)
    for name, method in train.METHODS.items():
        assert f"| {method.label} |" in text, name
    for name in ("non_private", "ours", "opacus_ghost_untied", "naive_vmap"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert len(row["times_s"]) == 2 and row["step_s"] > 0
        # parameters + what the steps allocate: at least the weights, under 1 GiB for the toy model
        assert row["param_bytes"] <= row["peak_bytes"] < 2**30
    assert rows["non_private"]["time_ratio"] == 1.0
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_opacus_tied_failure_is_reported_not_hidden(quick):
    results, text, _ = quick
    row = next(r for r in results["methods"] if r["method"] == "opacus_ghost")
    assert row["status"] == "error: NotImplementedError: Parameter tying is not supported with Ghost Clipping"
    assert row["status"] in text
    tied_target = next(t for t in results["targets"] if "tied embeddings" in t["target"])
    assert tied_target["result"] == "n/a" and "Parameter tying" in tied_target["measured"]


def test_our_first_batch_norms_equal_torch_func(quick):
    """Same seeded weights and batch in two processes: our book-keeping norms and vmap(grad)'s
    agree to float32 rounding (NORM_RTOL, derived in the module); a wrong norm (e.g. the tied
    cross term dropped) is off by O(1)."""
    results, text, _ = quick
    check = results["norm_check"]
    assert check["result"] == "PASS" and check["max_rel_diff"] <= train.NORM_RTOL
    rows = {r["method"]: r for r in results["methods"]}
    assert len(rows["ours"]["first_norms"]) == train.PRESETS["toy"].batch
    assert "Per-sample norm check (ours vs torch.func, first batch): **PASS**" in text


def _row(name, step_s=None, peak=None, status="ok"):
    row = {"method": name, "status": status}
    if status == "ok":
        row.update(step_s=step_s, peak_bytes=peak)
    return row


def test_targets_pass_fail_and_na():
    rows = [
        _row("non_private", 1.0, 100),
        _row("ours", 1.4, 140),
        _row("opacus_ghost", status="error: NotImplementedError: tying"),
        _row("opacus_ghost_untied", 1.3, 120),
    ]
    train.add_ratios(rows)
    got = {t["target"]: (t["measured"], t["result"]) for t in train.targets(rows)}
    assert got["ours step time <= 1.5x non-private"] == ("1.40x", "PASS")
    assert got["ours peak memory <= 1.3x non-private"] == ("1.40x", "FAIL")
    tied = next(v for k, v in got.items() if "tied embeddings" in k)
    assert tied == ("error: NotImplementedError: tying", "n/a")
    untied = next(v for k, v in got.items() if "untied head" in k)
    assert untied[1] == "FAIL" and untied[0].startswith("Opacus 0.93x")


def test_norm_check_verdicts():
    rows = [{"method": "ours", "first_norms": [1.0, 2.0]}, {"method": "naive_vmap", "first_norms": [1.0, 2.0 * (1 + 1e-3)]}]
    assert train.norm_check(rows, "none")["result"] == "FAIL"
    assert train.norm_check(rows, "bf16")["result"] == "n/a"  # a value, but no verdict under autocast
    rows[1]["first_norms"] = [1.0, 2.0 * (1 + 1e-5)]
    assert train.norm_check(rows, "none")["result"] == "PASS"
    assert train.norm_check(rows[:1], "none")["result"] == "n/a"


def test_naive_skip_reason_when_per_sample_grads_exceed_half_the_free_memory():
    device = train.torch.device("cpu")
    free = train.free_bytes(device)
    huge = train.ModelSize(vocab=50257, n_embd=768, n_layer=12, n_head=12, seq_len=512, batch=1 << 20)
    assert train.naive_skip_reason(huge, 124_000_000, device).startswith("skipped: per-sample gradients need")
    assert train.naive_skip_reason(train.PRESETS["toy"], 45_000, device) == "" and free > 0


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit, match="unknown or no methods"):
        train.main(["--quick", "--methods", "ours,fast"])
    with pytest.raises(SystemExit, match="need batch >= 1"):
        train.main(["--quick", "--batch", "-1"])


def test_a_worker_past_its_timeout_is_an_error_row_and_is_stopped(quick):
    spec = train.BenchSpec(
        size=train.PRESETS["toy"], device="cpu", autocast="none", warmup=0, steps=1, seed=0,
        noise_multiplier=1.0, clip_norm=1.0, lr=1e-4,
    )
    row = train.run_isolated("ours", spec, timeout=0.01)
    assert row["status"] == "error: no result within 0 s" and row["label"] == train.METHODS["ours"].label
