"""`python -m benchmarks.whisper`: options, the row/eps job list, DP sections, WER aggregation, the report
from a fake result, the tree refusal (planning only). The end-to-end run starts vLLM servers
(minutes): it runs only with VLLM_DP_SLOW=1 (and vllm installed)."""

import json
import os
from pathlib import Path

import pytest

from benchmarks import SUITES
from benchmarks import whisper as bench
from vllm_dp_plugin.cli import BENCH_SUITES
from vllm_dp_plugin.models.speech import word_error_rate, words

slow = pytest.mark.skipif(not os.environ.get("VLLM_DP_SLOW"), reason="slow (vLLM servers): set VLLM_DP_SLOW=1")


# --------------------------------------------------------------------------- options and jobs
def test_the_suite_is_a_research_suite_of_the_repository():
    assert "whisper" in SUITES and "whisper" not in BENCH_SUITES
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    assert exit_.value.code == 0


def test_default_arguments():
    args = bench.build_parser().parse_args([])
    assert args.rows == ("stock", "stock_server", "dp_off") and args.modes == ("state",)
    assert args.eps == (8.0, 64.0, 1000.0) and args.calibration == "speech" and args.quantile == 0.999
    assert args.attention is None and args.limit is None and not args.quick and args.stock_worker is None
    args = bench.build_parser().parse_args(["--modes", "state,tree", "--eps", "1,1e3", "--rows", "dp_off",
                                            "--attention", '{"degree": 1}', "--limit", "3"])
    assert args.modes == ("state", "tree") and args.eps == (1.0, 1000.0) and args.rows == ("dp_off",)
    assert args.attention == {"degree": 1} and args.limit == 3
    assert bench.build_parser().parse_args(["--modes", ""]).modes == ()


def test_job_list_rows_once_then_every_mode_at_every_eps_with_the_kernel_only_eps():
    jobs = bench.jobs_of(bench.BASE_ROWS, ("state", "tree"), (8.0, 64.0, 1000.0))
    assert [(j.row, j.eps) for j in jobs] == [
        ("stock", None), ("stock_server", None), ("dp_off", None),
        ("dp_state", 8.0), ("dp_state", 64.0), ("dp_state", 1000.0), ("dp_state", 1e7),
        ("dp_tree", 8.0), ("dp_tree", 64.0), ("dp_tree", 1000.0), ("dp_tree", 1e7)]
    assert [j.mode for j in jobs[2:5]] == [None, "state", "state"]
    assert jobs[3].label == "dp_state eps=8" and jobs[0].label == "stock"
    assert [j.eps for j in bench.jobs_of((), ("state",), (1e7, 8.0, 8.0))] == [1e7, 8.0]  # once each
    assert bench.jobs_of(("dp_off",), (), (8.0,)) == [bench.Job("dp_off")]  # no DP rows: no eps
    for bad in ((("nope",), (), ()), ((), ("reference",), (8.0,)), ((), ("state",), (0.0,))):
        with pytest.raises(SystemExit):
            bench.jobs_of(*bad)


def test_settings_quick_and_limit():
    parse = bench.build_parser().parse_args
    jobs, references = bench.settings(parse(["--quick"]))
    assert references == list(bench.SENTENCES[:2])
    assert [(j.row, j.eps) for j in jobs] == [("stock", None), ("stock_server", None), ("dp_off", None),
                                              ("dp_state", 8.0)]
    jobs, references = bench.settings(parse(["--limit", "5", "--modes", "tree", "--eps", "8"]))
    assert len(references) == 5 and [(j.row, j.eps) for j in jobs][3:] == [("dp_tree", 8.0), ("dp_tree", 1e7)]


def test_sentences_are_fixed_and_calibration_audio_is_other_speech():
    assert len(bench.SENTENCES) == 12 and len(set(bench.SENTENCES)) == 12
    assert not set(bench.SENTENCES) & set(bench.CALIBRATION_SENTENCES)
    assert bench.WARMUP_SENTENCE in bench.CALIBRATION_SENTENCES


def test_dp_sections_keep_key_and_ledger_in_the_run_and_pick_the_composition(tmp_path):
    assert bench.composition(8.0) == bench.composition(100.0) == "pld" and bench.composition(1000.0) == "basic"
    off = bench.dp_config(tmp_path, None)["dp_privacy"]
    assert off == {"key_file": str(tmp_path / "noise.key"), "ledger": str(tmp_path / "ledger.sqlite")}
    att = bench.attention_section("state", 1e7, tmp_path / "cal.json", {"degree": 1})
    assert att == {"mode": "state", "epsilon": 1e7, "delta": bench.DELTA, "composition": "basic",
                   "calibration": str(tmp_path / "cal.json"), "degree": 1}
    from vllm_dp_plugin.config import parse_section

    parsed = parse_section(bench.dp_config(tmp_path, att)["dp_privacy"])  # a valid section
    assert parsed.attention.composition == "basic" and parsed.key_file.startswith(str(tmp_path))


def test_server_commands(tmp_path):
    from transformers import WhisperConfig

    from vllm_dp_plugin.serving.memory import kv_cache_flags

    m = str(tmp_path / "m")  # a config-only Whisper (the KV cache is sized from it)
    WhisperConfig().save_pretrained(m)
    flags = [*bench.SERVE_FLAGS, *kv_cache_flags(m, bench.MAX_MODEL_LEN)]
    cmd, env = bench.server_command(m, bench.Job("stock_server"), tmp_path, None)
    assert env["VLLM_PLUGINS"] == "" and cmd[-len(flags):] == flags and "--dp-config" not in cmd
    att = bench.attention_section("state", 8.0, "cal.json")
    cmd, env = bench.server_command(m, bench.Job("dp_state", 8.0), tmp_path, att)
    assert "VLLM_PLUGINS" not in env and cmd[cmd.index("serve") + 1] == m and cmd[-len(flags):] == flags
    config = json.loads(Path(cmd[cmd.index("--dp-config") + 1]).read_text())
    assert config["dp_privacy"]["attention"] == att
    cmd, _ = bench.server_command(m, bench.Job("dp_off"), tmp_path, None)
    assert "attention" not in json.loads(Path(cmd[cmd.index("--dp-config") + 1]).read_text())["dp_privacy"]


# --------------------------------------------------------------------------- scoring
def test_wer_aggregation_is_the_corpus_rate():
    refs = ["the cat sat", "a b c d e"]
    hyps = ["The cat sat.", "a x c"]  # 0 edits; 1 substitution + 2 deletions
    scored = bench.score(refs, hyps)
    assert scored["errors"] == 3 and scored["words"] == 8 and scored["wer"] == pytest.approx(3 / 8)
    assert scored["wer"] == word_error_rate(refs, hyps)
    assert scored["sentence_wer"] == [0.0, pytest.approx(3 / 5)]
    assert bench.sentence_errors("one two", "") == (2, 2)
    assert bench.sentence_errors("one", "one two three") == (2, 1)  # insertions: WER above 1
    assert bench.score(["one"], ["one two three"])["wer"] == 2.0


def test_summary_rows_and_the_dp_off_check():
    refs = list(bench.SENTENCES[:2])
    stock = bench.summarize(bench.Job("stock"), refs, [" " + refs[0], refs[1]], [1.0, 3.0])
    assert stock["wer"] == 0.0 and stock["seconds_per_request"] == 2.0 and stock["n"] == 2 and stock["empty"] == 0
    assert stock["eps"] is None and stock["composition"] is None and "budget" not in stock
    off = bench.summarize(bench.Job("dp_off"), refs, list(refs), [1.0, 1.0])
    assert bench.checks([stock, off])["dp_off_equals_stock"] == {"equal": True, "differ": []}
    bad = bench.summarize(bench.Job("dp_off"), refs, [refs[0], ""], [1.0, 1.0])
    assert bad["empty"] == 1 and bad["errors"] == len(words(refs[1]))
    assert bench.checks([stock, bad]) == {"dp_off_equals_stock": {"equal": False, "differ": [1]},
                                          "stock_server_equals_stock": None}


def fake_result() -> dict:
    refs = list(bench.SENTENCES[:3])
    budget = {"mode": "state", "unit": "one private K/V row of one attention layer", "context": "each request's "
              "encoder output", "composition": "pld", "spent": {"epsilon": 8.0, "delta": 1e-6},
              "per_release": {"epsilon": 1.55, "delta": 4e-8, "mechanism": "gaussian"},
              "noise_std": [880.0, 1210.0], "logit_bound": [28.4, 37.2], "taylor_degree": [2, 2],
              "kernel_error": [None, None], "regime": "no gate", "not": "kept out"}
    rows = [bench.summarize(bench.Job("stock"), refs, refs, [1.0] * 3),
            bench.summarize(bench.Job("stock_server"), refs, ["", "", ""], [0.5] * 3),
            bench.summarize(bench.Job("dp_off"), refs, refs, [1.0] * 3),
            bench.summarize(bench.Job("dp_state", 8.0), refs, ["you", "", ""], [2.0] * 3, budget),
            bench.summarize(bench.Job("dp_state", 1e7), refs, ["you", "you", "you"], [2.0] * 3, budget),
            bench.refused(bench.Job("dp_tree", 8.0), "tree mode needs ~19.15 GiB per layer\nmore")]
    return {"model": ".models/whisper-tiny-en", "device": "cpu-2core", "date": "2026-11-26",
            "command": "python -m benchmarks.whisper", "references": refs, "max_tokens": bench.MAX_TOKENS,
            "calibration": {"description": "speech"}, "rows": rows, "checks": bench.checks(rows)}


def test_markdown_and_plot_from_a_fake_result(tmp_path):
    data = fake_result()
    assert "not" not in data["rows"][3]["budget"] and data["rows"][3]["budget"]["noise_std"] == [880.0, 1210.0]
    text = bench.markdown(data)
    assert "| stock |  |  |  | 0.000 | 0/" in text and "| 3/3 |" in text  # stock_server: 3 empty
    assert "| dp_state | state | 8 | pld | 1.000 |" in text and "| dp_state | state | 1e+07 | basic |" in text
    assert "| dp_tree | tree | 8 |  | refused |" not in text and "| dp_tree | tree | 8 | pld | refused |" in text
    assert "`dp_off` transcribes every sentence exactly as `stock`: **yes**" in text
    assert "**NO (sentences [0, 1, 2] differ)**" in text and "tree mode needs ~19.15 GiB per layer" in text
    assert "| dp_state | 8 | 8 | 1.00e-06 | eps 1.55, gaussian | 880-1.21e+03 | 28.4-37.2 | 2 | unbounded |" in text
    assert "`dp_state eps=1e+07`: “you”" in text and "`stock_server`: (empty)" in text
    assert "{" not in text.replace("{0", "")  # no unformatted placeholders
    bench.plot(data, tmp_path / "w.png")
    assert (tmp_path / "w.png").stat().st_size > 1000


def test_tree_refusal_is_planned_from_public_inputs(tmp_path):
    from transformers import WhisperConfig

    WhisperConfig(d_model=384, encoder_attention_heads=6, decoder_attention_heads=6, encoder_layers=1,
                  decoder_layers=2, max_source_positions=1500, vocab_size=64).save_pretrained(tmp_path)
    bounds = {"key_bound": 3.0, "query_bound": 10.0, "value_bound": 2.0, "key_norm": 10.0, "query_norm": 20.0}
    tree = {"mode": "tree", "epsilon": 8.0, "delta": 1e-6, "bounds": bounds}
    reason = bench.tree_refusal(str(tmp_path), tree)
    assert reason.startswith("attention.mode: tree needs ~19.") and "1500 rows (Taylor degree 2, 2145 features" in reason
    assert bench.tree_refusal(str(tmp_path), {**tree, "degree": 1}) is None  # ~0.6 GiB a layer


def test_a_start_that_dies_is_retried_then_raised():
    calls, logged = [], []

    def start():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("server exited (-9)")
        return "up"

    assert bench.retried(start, "x", attempts=3, wait=0, log=logged.append) == "up" and len(logged) == 2
    calls.clear()
    with pytest.raises(RuntimeError, match="exited"):
        bench.retried(start, "x", attempts=2, wait=0, log=logged.append)


# --------------------------------------------------------------------------- end to end (slow)
@slow
@pytest.mark.vllm
def test_quick_run_dp_off_and_state_on_whisper_tiny_en(tmp_path):
    model = Path(bench.DEFAULT_MODEL)
    if not (model / "config.json").exists():
        pytest.skip(f"no {model} (vllm-dp import-model whisper-tiny-en {model})")
    out = tmp_path / "results"
    assert bench.main(["--quick", "--rows", "dp_off", "--out", str(out),
                 "--cache-dir", str(tmp_path / "cache"), "--date", "test"]) == 0
    data = json.loads(next(out.glob("whisper-*-test.json")).read_text())
    assert [(r["row"], r["eps"]) for r in data["rows"]] == [("dp_off", None), ("dp_state", 8.0)]
    assert data["rows"][0]["wer"] < 0.5 and data["rows"][1]["budget"]["spent"]["epsilon"] == pytest.approx(8.0)
