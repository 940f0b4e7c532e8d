"""`python -m benchmarks.prompt_ttft`: configurations, summary and CLI routing (the run itself starts
two vLLM servers per repeat and is exercised by the benchmark, not here)."""

import argparse
import json

import pytest

from benchmarks.prompt_ttft import config_of, summary
from vllm_dp_plugin.cli import BENCH_SUITES, main
from vllm_dp_plugin.config import DPPrivacyConfig


def test_prompt_config_is_a_valid_dp_private_server(tmp_path):
    args = argparse.Namespace(mechanism="laplace", epsilon=7.0, search="hnsw")
    flags, env = config_of("prompt-int8", args, tmp_path)
    assert flags[flags.index("--tokenizer-mode") + 1] == "dp_private" and env["VLLM_PLUGINS"] == "dp_privacy"
    assert "--disable-log-stats" in flags  # required where a request may pick paraphrase
    cfg = DPPrivacyConfig.from_dict(json.loads(flags[flags.index("--additional-config") + 1])["dp_privacy"])
    assert cfg.prompt.mechanism == "laplace" and cfg.prompt.epsilon == 7.0 and cfg.attention is None
    assert cfg.prompt.search == "hnsw" and cfg.prompt.fast_dtype == "int8"
    flags, env = config_of("stock", args, tmp_path)
    assert flags == ["--disable-log-stats"] and env["VLLM_PLUGINS"] == ""


def test_summary_takes_the_median_run_and_judges_the_overhead():
    rows = [{"config": c, "mean_ttft_ms": t, "median_ttft_ms": t} for c, t in
            [("stock", 10.0), ("prompt-auto", 10.5), ("prompt-float32", 14.0), ("stock", 30.0),
             ("prompt-auto", 11.5), ("prompt-float32", 15.0), ("stock", 12.0), ("prompt-auto", 12.9),
             ("prompt-float32", 16.0)]]
    names = ["stock", "prompt-auto", "prompt-float32"]
    out = summary(rows, names)
    assert out["stock"]["mean_ttft_ms"] == 12.0 and out["prompt-auto"]["mean_ttft_ms"] == 11.5
    assert out["overhead"] == pytest.approx(11.5 / 12.0 - 1) and out["verdict"] == "PASS"
    assert out["prompt-float32"]["overhead"] == pytest.approx(15.0 / 12.0 - 1)
    assert out["prompt-float32"]["verdict"] == "FAIL"
    rows[1]["mean_ttft_ms"] = rows[4]["mean_ttft_ms"] = 20.0
    assert summary(rows, names)["verdict"] == "FAIL"


@pytest.mark.parametrize("suite", sorted(BENCH_SUITES))
def test_every_bench_suite_is_routed(suite, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", suite, "--help"])
    assert exit_.value.code == 0 and f"vllm-dp bench {suite}" in capsys.readouterr().out


def test_wide_shape_has_a_real_models_search_to_body_ratio():
    """--shape wide: the vocabulary search (V d MACs per token) is a few percent of the body's
    per-token MACs, as in real models; the demo's is comparable to its whole body."""
    from benchmarks.prompt_ttft import SHAPES
    from vllm_dp_plugin.demo import DemoLlamaShape

    def search_to_body(shape: DemoLlamaShape) -> float:
        d, kv = shape.hidden_size, shape.num_key_value_heads * (shape.hidden_size // shape.num_attention_heads)
        layer = 2 * d * d + 2 * d * kv + 3 * d * shape.intermediate_size  # q, o, k, v, MLP
        return shape.vocab_size * d / (shape.num_hidden_layers * layer)

    assert search_to_body(DemoLlamaShape(**SHAPES["demo"])) > 0.5  # 0.89
    assert search_to_body(DemoLlamaShape(**SHAPES["wide"])) < 0.1  # 0.044
