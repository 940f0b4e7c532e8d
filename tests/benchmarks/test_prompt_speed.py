"""``python -m benchmarks.prompt_speed --quick`` (``benchmarks.prompt_speed``): runs end to end and writes the md + json tables."""

import json

from benchmarks import prompt_speed

DATE = "2026-11-22"


def test_quick_run_writes_tables_with_positive_throughput(tmp_path):
    rc = prompt_speed.main(["--quick", "--out", str(tmp_path), "--date", DATE, "--quiet"])
    assert rc == 0
    label = prompt_speed.device_label(prompt_speed.torch.device("cpu"))
    assert label.startswith("cpu-") and label.endswith("core")
    stem = tmp_path / f"prompt-speed-{label}-{DATE}"
    results = json.loads(stem.with_name(stem.name + ".json").read_text())
    text = stem.with_name(stem.name + ".md").read_text()

    nearest, privatizer = results["nearest"], results["privatizer"]
    # quick: 2 tables x 2 batches x (fp32: torch and, where it builds, torch + the C++ select;
    # bf16: torch; int8: its own certified search, under the torch pass's name)
    fused = prompt_speed.default_select("cpu") is not prompt_speed.select_within_bound
    passes = {"torch", "torch+C++ select"} if fused else {"torch"}
    assert len(nearest) == len(privatizer) == 4 * (2 + len(passes))
    for row in nearest + privatizer:
        assert row["status"] == "ok" and row["pass"] in passes, row
        assert row["pass"] == "torch" or row["dtype"] == "fp32"
        assert row["tokens_per_s"] > 0 and row["seconds"] > 0
    assert {(r["dtype"], r["batch"]) for r in nearest} == {
        (d, b) for d in ("fp32", "bf16", "int8") for b in (32, 128)
    }
    # the fp32 torch pass is its own reference and the int8 pass is certified equal to it; bf16 +
    # re-rank almost always agrees with it
    assert all(r["agree_fp32_torch"] == 1.0 for r in nearest if r["dtype"] in ("fp32", "int8"))
    assert all(r["agree_fp32_torch"] >= 0.9 for r in nearest)
    assert all(r["mechanism"] == "trlap_corrected" and r["epsilon"] == 10.0 for r in privatizer)
    assert results["meta"]["device"] == label and results["meta"]["date"] == DATE

    assert "## 1. Nearest-candidate step" in text and "## 2. Whole `TokenPrivatizer`" in text
    assert "| 2000 x 64 | bf16 | torch | 128 |" in text
    assert "| 3000 x 128 | fp32 | torch | 32 |" in text


def test_skips_are_reported_not_run(tmp_path):
    """A case over --max-macs is listed with its reason instead of being timed."""
    rc = prompt_speed.main(
        [
            "--quick",
            "--out",
            str(tmp_path),
            "--date",
            DATE,
            "--quiet",
            "--parts",
            "nearest",
            "--tables",
            "1000x32",
            "--batches",
            "16,64",
            "--dtypes",
            "fp32",
            "--max-macs",
            "1e6",
        ]
    )
    assert rc == 0
    (path,) = tmp_path.glob("prompt-speed-*.json")
    rows = json.loads(path.read_text())["nearest"]
    by_batch = {r["batch"]: r for r in rows}
    assert by_batch[16]["status"] == "ok" and by_batch[16]["tokens_per_s"] > 0  # 16*1000*32 = 5e5
    assert by_batch[64]["status"].startswith("skipped") and "tokens_per_s" not in by_batch[64]


def test_roofline_rows_verdicts_and_target_lines(tmp_path):
    """Part 3: skipped without CUDA or the interpreter (where it ran, its rows are timed); a verdict
    only at 128k x 4096, one n/a line when no row is there."""
    rc = prompt_speed.main(["--quick", "--out", str(tmp_path), "--date", DATE, "--quiet", "--parts", "roofline",
                            "--tables", "1000x32", "--batches", "16"])
    assert rc == 0
    (path,) = tmp_path.glob("prompt-speed-*.json")
    results = json.loads(path.read_text())
    assert [r["dtype"] for r in results["roofline"]] == ["fp32", "bf16"]
    for row in results["roofline"]:
        assert row["status"] == "ok" or row["status"].startswith("skipped: the Triton pass needs")
        assert row["status"] != "ok" or (row["fraction"] == row["gemm_s"] / row["kernel_s"] and row["target"] == "-")
    assert prompt_speed.target_lines(results) == [
        "n/a  nearest-candidate kernel >= 50% of the GEMM roofline at 128000 x 4096 (not measured in this run)"]
    row = {"vocab": 128000, "dim": 4096, "dtype": "bf16", "batch": 4096, "fraction": 0.62, "kernel_tflops": 400.0,
           "gemm_tflops": 645.0}
    row["target"] = prompt_speed.roofline_verdict(row)
    assert row["target"] == "PASS" and prompt_speed.roofline_verdict({**row, "fraction": 0.49}) == "FAIL"
    assert prompt_speed.roofline_verdict({**row, "vocab": 30000}) == "-"
    assert prompt_speed.target_lines({"roofline": [row]}) == [
        ("PASS nearest-candidate kernel >= 50% of the GEMM roofline at 128000 x 4096 (bf16, batch 4096): 62.0% "
         "(400 vs 645 TFLOP/s)")]
    assert "## 3. Nearest-candidate kernel vs the GEMM roofline" in path.with_suffix(".md").read_text()
