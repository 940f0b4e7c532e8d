"""``python -m benchmarks.train`` (``benchmarks.train``): ``--quick`` end to end (every method row, files written), the
verdict helpers, and the worker isolation (an error or a timeout is a row, not a crash); ``--model`` on a tiny
random tied Llama directory (full and LoRA rows, its targets, the tiny-Llama norm check, Opacus' hooks
fallback)."""

import json

import pytest
import torch

from benchmarks.lib.measure import free_bytes
from benchmarks.train import (
    MODEL_BATCH,
    _methods_from_args,
    _spec_from_args,
    build_parser,
    main,
    methods,
)
from benchmarks.train.measure import measure_method, run_isolated
from benchmarks.train.methods import METHODS, PRESET_METHODS, naive_skip_reason
from benchmarks.train.spec import PRESETS, BenchSpec, ModelSize, load_model
from benchmarks.train.verdicts import NORM_RTOL, add_ratios, norm_check, targets
from vllm_dp_plugin.benchmarks.lib.scenarios import resolve_model
from vllm_dp_plugin.trainer.lora import LoraSpec

DATE = "2026-11-23"


def written(stem):
    """(results, markdown, png path) a run wrote under ``stem``."""
    return (
        json.loads(stem.with_name(stem.name + ".json").read_text()),
        stem.with_name(stem.name + ".md").read_text(),
        stem.with_name(stem.name + ".png"),
    )


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    assert main(["--quick", "--out", str(out), "--date", DATE, "--quiet"]) == 0
    return written(out / f"train-cpu-{DATE}")


def test_quick_run_has_every_method_row(quick):
    results, text, png = quick
    rows = {r["method"]: r for r in results["methods"]}
    assert list(rows) == PRESET_METHODS == [n for n, m in METHODS.items() if not m.lora]
    for name in PRESET_METHODS:
        assert f"| {METHODS[name].label} |" in text, name
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
    assert check["result"] == "PASS" and check["max_rel_diff"] <= NORM_RTOL
    rows = {r["method"]: r for r in results["methods"]}
    assert len(rows["ours"]["first_norms"]) == PRESETS["toy"].batch
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
    add_ratios(rows)
    got = {t["target"]: (t["measured"], t["result"]) for t in targets(rows)}
    assert got["ours step time <= 1.5x non-private"] == ("1.40x", "PASS")
    assert got["ours peak memory <= 1.3x non-private"] == ("1.40x", "FAIL")
    tied = next(v for k, v in got.items() if "tied embeddings" in k)
    assert tied == ("error: NotImplementedError: tying", "n/a")
    untied = next(v for k, v in got.items() if "untied head" in k)
    assert untied[1] == "FAIL" and untied[0].startswith("Opacus 0.93x")


def test_norm_check_verdicts():
    rows = [{"method": "ours", "first_norms": [1.0, 2.0]}, {"method": "naive_vmap", "first_norms": [1.0, 2.0 * (1 + 1e-3)]}]
    assert norm_check(rows, "none")["result"] == "FAIL"
    assert norm_check(rows, "bf16")["result"] == "n/a"  # a value, but no verdict under autocast
    rows[1]["first_norms"] = [1.0, 2.0 * (1 + 1e-5)]
    assert norm_check(rows, "none")["result"] == "PASS"
    assert norm_check(rows[:1], "none")["result"] == "n/a"


def test_naive_skip_reason_when_per_sample_grads_exceed_half_the_free_memory():
    device = torch.device("cpu")
    free = free_bytes(device)
    huge = ModelSize(vocab=50257, n_embd=768, n_layer=12, n_head=12, seq_len=512, batch=1 << 20)
    assert naive_skip_reason(huge, 124_000_000, device).startswith("skipped: per-sample gradients need")
    assert naive_skip_reason(PRESETS["toy"], 45_000, device) == "" and free > 0


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit, match="unknown or no methods"):
        main(["--quick", "--methods", "ours,fast"])
    with pytest.raises(SystemExit, match="need batch >= 1"):
        main(["--quick", "--batch", "-1"])


def test_a_worker_past_its_timeout_is_an_error_row_and_is_stopped(quick):
    spec = BenchSpec(
        size=PRESETS["toy"], device="cpu", autocast="none", warmup=0, steps=1, seed=0,
        noise_multiplier=1.0, clip_norm=1.0, lr=1e-4,
    )
    row = run_isolated("ours", spec, timeout=0.01)
    assert row["status"] == "error: no result within 0 s" and row["label"] == METHODS["ours"].label


# ---------------------------------------------------------------------------------- --model (a Llama directory)

LLAMA = "tiny-llama"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random 2-layer Llama with a tied embedding, saved as a Hugging Face directory (SmolLM2's
    layout, 512-token vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("models") / LLAMA
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _model_args(llama_dir, *extra):
    return ["--model", str(llama_dir), "--batch", "2", "--seq-len", "8", "--steps", "1", "--warmup", "0", *extra]


@pytest.fixture(scope="module")
def model_run(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("train-model")
    assert main([*_model_args(llama_dir), "--out", str(out), "--date", DATE, "--quiet"]) == 0
    return written(out / f"train-{LLAMA}-cpu-{DATE}")


def test_model_run_has_full_and_lora_rows(model_run):
    results, text, png = model_run
    rows = {r["method"]: r for r in results["methods"]}
    assert list(rows) == list(METHODS)  # --model: every method, the LoRA ones included
    for name, method in METHODS.items():
        row = rows[name]
        assert row["lora"] == method.lora and f"| {row['label']} |" in text, name
        if name != "opacus_ghost":
            assert row["status"] == "ok", row
            assert len(row["times_s"]) == 1 and row["param_bytes"] <= row["peak_bytes"] < 2**30
    # LoRA trains the adapters only: r (d_in + d_out) per projection, 7 projections, 2 layers
    lora = 2 * 8 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)
    assert rows["ours_lora"]["parameters"] == rows["opacus_lora"]["parameters"] == lora
    full = 512 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3 + 2 * 64) + 64  # the tied table once
    assert rows["ours"]["parameters"] == rows["non_private"]["parameters"] == full
    assert rows["opacus_ghost_untied"]["parameters"] == rows["ours"]["parameters"] + 512 * 64  # its own head
    assert rows["opacus_lora"]["opacus_mode"] == "ghost"
    # each row against its own baseline
    assert rows["non_private"]["time_ratio"] == rows["non_private_lora"]["time_ratio"] == 1.0
    assert rows["ours_lora"]["time_ratio"] == rows["ours_lora"]["step_s"] / rows["non_private_lora"]["step_s"]
    assert results["meta"]["lora_parameters"] == lora and results["meta"]["model_path"].endswith(LLAMA)
    assert results["meta"]["size"]["vocab"] == 512 and "(llama, tied embeddings, pretrained)" in results["meta"]["model"]
    assert text.startswith(f"# DP training step, {LLAMA}: cpu ({DATE})")
    assert "LoRA rows: `peft` adapters r = 8, alpha = 16 on q_proj, k_proj, v_proj, o_proj, gate_proj" in text
    assert png.stat().st_size > 1000


def test_model_run_targets_and_the_tied_refusal(model_run):
    results, text, _ = model_run
    got = {t["target"]: t for t in results["targets"]}
    assert list(got) == [
        "ours step time <= 1.25x non-private",
        "ours peak memory <= 1.2x non-private",
        "ours LoRA step time <= 1.15x non-private LoRA",
        "ours LoRA peak memory <= 1.15x non-private LoRA",
        "ours (tied) faster than Opacus ghost clipping, tied embeddings",
        "ours (tied) faster than Opacus ghost clipping, untied head (its only runnable model)",
        "ours LoRA faster than Opacus LoRA",
    ]
    assert "Parameter tying is not supported with Ghost Clipping" in got[
        "ours (tied) faster than Opacus ghost clipping, tied embeddings"]["measured"]
    assert got["ours LoRA faster than Opacus LoRA"]["measured"].startswith("Opacus (ghost mode) ")
    for t in results["targets"]:
        assert f"| {t['target']} | {t['measured']} | {t['result']} |" in text


def test_model_run_norm_checks(model_run):
    """The tiny model fits the naive per-sample gradients, so both checks run: on the model itself
    and on the random 2-layer Llama of its shape (full and LoRA)."""
    results, text, _ = model_run
    assert results["norm_check"]["result"] == "PASS"
    tiny = results["tiny_norm_check"]
    assert tiny["result"] == "PASS", tiny
    assert tiny["max_rel_diff_full"] <= NORM_RTOL and tiny["max_rel_diff_lora"] <= NORM_RTOL
    assert "Per-sample norm check on a tiny Llama (ours vs torch.func): **PASS**: random 2-layer llama" in text


def test_model_targets_pass_fail():
    rows = [
        _row("non_private", 1.0, 100), _row("ours", 1.2, 125),
        _row("opacus_ghost", status="error: NotImplementedError: tying"), _row("opacus_ghost_untied", 1.5, 110),
        _row("non_private_lora", 1.0, 100), _row("ours_lora", 1.1, 110), _row("opacus_lora", 1.32, 105),
    ]
    rows[-1]["opacus_mode"] = "hooks"
    add_ratios(rows)
    assert rows[-1]["time_ratio"] == pytest.approx(1.32)  # against non-private LoRA
    got = {t["target"]: (t["measured"], t["result"]) for t in targets(rows, real_model=True)}
    assert got["ours step time <= 1.25x non-private"] == ("1.20x", "PASS")
    assert got["ours peak memory <= 1.2x non-private"] == ("1.25x", "FAIL")
    assert got["ours LoRA step time <= 1.15x non-private LoRA"] == ("1.10x", "PASS")
    assert got["ours LoRA faster than Opacus LoRA"] == ("Opacus (hooks mode) 1.20x our step time", "PASS")
    # the presets keep their own bounds and no LoRA rows
    assert [t["target"] for t in targets(rows)][:2] == [
        "ours step time <= 1.5x non-private", "ours peak memory <= 1.3x non-private"]
    assert len(targets(rows)) == 4
    # on CUDA full fine-tuning's time bound is 1.2x (the GPU target)
    got = {t["target"]: (t["measured"], t["result"]) for t in targets(rows, real_model=True, device_type="cuda")}
    assert got["ours step time <= 1.2x non-private"] == ("1.20x", "PASS")


def test_config_only_model_runs_with_random_weights(llama_dir, tmp_path):
    """A directory with only the architecture (config.json): seeded random weights, said so."""
    config_only = tmp_path / "arch"
    config_only.mkdir()
    (config_only / "config.json").write_text((llama_dir / "config.json").read_text())
    out = tmp_path / "out"
    argv = [*_model_args(config_only), "--methods", "non_private,ours", "--out", str(out), "--date", DATE, "--quiet"]
    assert main(argv) == 0
    results, text, _ = written(out / f"train-arch-cpu-{DATE}")
    assert [r["status"] for r in results["methods"]] == ["ok", "ok"]
    assert results["meta"]["random_weights"] and "(llama, tied embeddings, random weights)" in results["meta"]["model"]
    assert "Random weights (seed 0) of" in text
    assert results["tiny_norm_check"]["result"] == "PASS"
    a, b = (load_model(str(config_only), True, 0, torch.device("cpu")) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))  # seeded


@pytest.mark.parametrize("when", ["make_private", "first step"])
def test_opacus_lora_falls_back_to_hooks_mode_when_ghost_refuses(llama_dir, monkeypatch, when):
    real = methods._opacus

    def refusing(model, batch, spec, mode):
        if mode == "ghost" and when == "make_private":
            raise NotImplementedError("ghost says no")
        step, wrapped = real(model, batch, spec, mode)
        if mode == "ghost":
            def refuse():
                raise NotImplementedError("ghost says no")
            return refuse, wrapped
        return step, wrapped

    monkeypatch.setattr(methods, "_opacus", refusing)
    spec = _spec_from_args(build_parser().parse_args(_model_args(llama_dir)), str(llama_dir))
    row = measure_method("opacus_lora", spec)  # in this process: the patch holds
    assert row["status"] == "ok", row
    assert row["opacus_mode"] == "hooks" and row["ghost_refusal"] == "NotImplementedError: ghost says no"
    assert row["label"] == "Opacus 1.6 hooks mode (ghost clipping refused), LoRA"


def test_model_arguments_are_checked(llama_dir, tmp_path):
    with pytest.raises(SystemExit, match="need --model"):
        main(["--quick", "--methods", "ours,ours_lora"])
    with pytest.raises(SystemExit, match="exclude each other"):
        main([*_model_args(llama_dir), "--preset", "tiny"])
    with pytest.raises(SystemExit, match="nor a directory with a config.json"):
        main(["--model", str(tmp_path)])
    assert _methods_from_args(None) == PRESET_METHODS
    assert _methods_from_args(None, real_model=True) == list(METHODS)
    args = build_parser().parse_args(["--model", str(llama_dir)])
    spec = _spec_from_args(args, str(llama_dir))
    assert (spec.size.batch, spec.size.seq_len) == MODEL_BATCH["cpu"] == (32, 128)
    assert spec.lora == LoraSpec() and spec.model == str(llama_dir)
    assert resolve_model(str(llama_dir)) == (LLAMA, str(llama_dir))
