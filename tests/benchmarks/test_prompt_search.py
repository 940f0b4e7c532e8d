"""``benchmarks.lib.prompt_search``: exact vs approximate search on the same noisy vectors (the
section ``python -m benchmarks.prompt_ttft --search hnsw|ivf`` adds), on a small synthetic table."""

import argparse

import pytest
import torch

from tests.prompt.conftest import make_table
from vllm_dp_plugin.prompt.privatizer import candidate_index

pytest.importorskip("faiss")

from benchmarks.lib.prompt_search import MAX_NW_GAP, compare, english_ids, markdown
from vllm_dp_plugin.prompt.approximate import ApproximateIndex


def test_compare_projects_the_same_noisy_vectors_with_both_searches(monkeypatch):
    table = make_table(vocab=800, dim=16)
    approx = ApproximateIndex.build(candidate_index(table), "hnsw")
    ids = table.candidates[torch.arange(0, 600, 3)]
    out = compare(table, approx, ids, mechanisms=("gaussian_analytic",), epsilons=(5.0, 500.0),
                  queries=64, repeats=2)
    low, high = out["rows"]
    assert out["speed"]["queries"] == 64 and len(out["speed"]["exact_ms_runs"]) == 2
    assert high["nw_exact"] > 0.9 > low["nw_exact"]  # eps matters: the rows are real measurements
    assert high["identical"] >= 0.98 and abs(high["nw_gap"]) <= MAX_NW_GAP
    # a broken index (always the first candidate) is caught by the identical-output fraction
    monkeypatch.setattr(approx, "nearest", lambda q, k=32, *a, **kw: table.candidates[:1].expand(q.shape[0]))
    broken = compare(table, approx, ids, mechanisms=("gaussian_analytic",), epsilons=(500.0,), queries=8, repeats=1)
    assert broken["rows"][0]["identical"] < 0.05 and broken["verdict"] == "FAIL"
    broken.update(table="t", build_s=0.1)
    text = "\n".join(markdown(broken))
    assert "| gaussian_analytic | 500 |" in text and "FAIL" in text


def test_english_ids_are_real_text():
    class Words:  # a whitespace tokenizer: one id per word
        def __init__(self):
            self.vocab = {}

        def encode(self, text, add_special_tokens=False):
            return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    tokenizer = Words()
    ids = english_ids(tokenizer, 500)
    assert ids.shape == (500,) and ids.dtype == torch.int64
    words = {i: w for w, i in tokenizer.vocab.items()}
    assert sum(words[int(i)] in {"the", "a", "is", "of"} for i in ids) > 20
    assert torch.equal(ids, english_ids(Words(), 500))  # seeded


def test_prompt_ttft_report_states_the_search_and_the_target_model():
    from benchmarks.prompt_ttft import TARGET_MODEL, summary
    from benchmarks.prompt_ttft import markdown as ttft_markdown

    rows = [{"config": c, "mean_ttft_ms": t, "median_ttft_ms": t} for c, t in [("stock", 100.0), ("prompt-auto", 105.0)]]
    args = argparse.Namespace(model=TARGET_MODEL, shape="demo", input_len=512, output_len=4, num_prompts=32,
                              repeats=1, mechanism="trlap_corrected", epsilon=10.0, search="ivf", fast_dtypes=["auto"])
    text = ttft_markdown(args, summary(rows, ["stock", "prompt-auto"]), {"device": "cpu", "date": "d", "command": "c"})
    assert "search `ivf`" in text and "SmolLM2" in text and "PASS." in text
