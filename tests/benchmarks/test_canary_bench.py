"""`vllm-dp bench canary` end to end on a 1-layer random Llama with SmolLM2's tokenizer (whose
digits are single tokens): every run is written with its perplexity and exposures, and the
summary is derived from them."""

import json
import math
from pathlib import Path

import pytest
import torch

from vllm_dp_plugin.benchmarks import canary

SMOLLM2 = Path(__file__).resolve().parents[2] / ".models" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tiny_smol(tmp_path_factory):
    if not SMOLLM2.exists():
        pytest.skip("no .models/smollm2-135m-instruct (make real-models)")
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tinysmol")
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_bench_canary_writes_every_run(tmp_path, tiny_smol):
    argv = ["--model", str(tiny_smol), "--max-docs", "5", "--val-records", "6", "--epsilons", "4",
            "--repetitions", "1,3", "--per-level", "1", "--digits", "2", "--seq-len", "16", "--batch-size", "8",
            "--out", str(tmp_path), "--date", "test", "--quiet"]
    assert canary.main(argv) == 0
    stem = next(tmp_path.glob("canary-*-test.json"))
    results = json.loads(stem.read_text())
    assert [r["name"] for r in results["runs"]] == ["base", "non-private", "dp eps=4"]
    base, plain, dp = results["runs"]
    assert plain["gain_kept"] == pytest.approx(1.0) and base["gain_kept"] == 0.0
    assert plain["epsilon"] is None and 3.8 <= dp["epsilon"] <= 4.0
    for run in results["runs"]:
        assert [c["repetitions"] for c in run["canaries"]] == [1, 3]
        for c in run["canaries"]:
            assert c["candidates"] == 100 and c["exposure"] == pytest.approx(math.log2(100 / c["rank"]))
        assert run["at_chance"] == all(c["chance_p"] >= 0.01 / 2 for c in run["canaries"])
    assert results["settings"]["records"] > 0 and results["settings"]["mode"].startswith("LoRA r=8 on q_proj")
    md = stem.with_suffix(".md").read_text()
    assert "| dp eps=4 |" in md and "exposure x3 (bits)" in md
    assert stem.with_suffix(".png").stat().st_size > 0
