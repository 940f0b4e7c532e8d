"""``python -m benchmarks.aggregate_batch`` (``benchmarks.aggregate_batch``): the member prompts (keyed
partition, chat layout, instruction), exactly the asked new tokens, and ``--quick`` end to end on
the demo model, with its weights and as a config-only directory (random weights)."""

import json
import shutil

import pytest
import torch

from benchmarks import SUITES
from benchmarks import aggregate_batch as bench
from vllm_dp_plugin.benchmarks.lib.scenarios import DEFAULT_SCENARIOS, load_scenarios
from vllm_dp_plugin.cli import BENCH_SUITES

DATE = "2026-11-27"


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from vllm_dp_plugin.demo import make_demo_llama

    return make_demo_llama(tmp_path_factory.mktemp("aggregate-batch") / "llama")


@pytest.fixture(scope="module")
def config_only(demo_model, tmp_path_factory):
    """The demo model's config.json and tokenizer, without its weights."""
    path = tmp_path_factory.mktemp("aggregate-batch") / "llama-config"
    shutil.copytree(demo_model, path, ignore=shutil.ignore_patterns("*.safetensors"))
    return path


def test_registered():
    assert "aggregate_batch" in SUITES and "aggregate-batch" not in BENCH_SUITES


def test_members_split_the_documents_by_keyed_hash():
    scenarios = load_scenarios(DEFAULT_SCENARIOS)[:3]
    docs = bench.collection(scenarios)
    assert len(docs.documents) == sum(len(s["documents"]) for s in scenarios)
    parts = docs.partition(21, bench.digest)
    assert sorted(d.id for part in parts for d in part) == sorted(d.id for d in docs.documents)
    again = docs.partition(21, bench.digest)
    assert parts == again  # the key is fixed: the same split every run
    assert bench.digest("a") != bench.digest("b") and len(bench.digest("a")) == 32


def test_member_prompts_hold_documents_question_and_instruction(demo_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    members = ["Memo: the warehouse closes on Friday.", ""]
    prompts = bench.member_prompts(tokenizer, members, "When does the warehouse close?")
    texts = [tokenizer.decode(p) for p in prompts]
    assert "warehouse closes on Friday" in texts[0] and "warehouse closes on Friday" not in texts[1]
    assert all(bench.INSTRUCTION in t and "When does the warehouse close?" in t for t in texts)
    plain = tokenizer.decode(bench.plain_prompt(tokenizer, "When does the warehouse close?"))
    assert "When does the warehouse close?" in plain and bench.INSTRUCTION not in plain


def test_greedy_generates_exactly_the_asked_tokens(demo_model):
    """The model's first greedy token made its EOS: plain generation stops after it, ``greedy``
    goes on to the asked count (rows of unequal length, left-padded)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    model = bench.load_causal_lm(demo_model, dtype=torch.float32).eval()
    prompt = tokenizer.encode("a b c")
    ids = torch.tensor([prompt])
    first = int(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)[0, -1])
    model.generation_config.eos_token_id = first
    stopped = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert stopped.shape[1] == len(prompt) + 1
    longer = tokenizer.encode("a much longer prompt of several words")
    assert bench.greedy(model, [prompt], 5, tokenizer.pad_token_id)() == 5
    assert bench.greedy(model, [prompt, longer], 5, tokenizer.pad_token_id)() == 5


def test_time_pair_refuses_short_generations():
    with pytest.raises(RuntimeError, match="generated 3 tokens, not 4"):
        bench.time_pair(lambda: 3, lambda: 4, "cpu", 4, warmup=0, repeats=1)
    out = bench.time_pair(lambda: 4, lambda: 4, "cpu", 4, warmup=1, repeats=2)
    assert len(out["batch_times_s"]) == len(out["plain_times_s"]) == 2
    assert out["ratio"] == out["batch_s"] / out["plain_s"]


@pytest.mark.parametrize("which", ["weights", "config only"])
def test_quick_run_writes_the_ratio_and_its_verdict(which, demo_model, config_only, tmp_path):
    model = demo_model if which == "weights" else config_only
    assert bench.main(["--quick", "--model", str(model), "--out", str(tmp_path), "--date", DATE, "--quiet"]) == 0
    stem = tmp_path / f"aggregate-batch-{model.name}-cpu-{DATE}"
    results = json.loads(stem.with_name(stem.name + ".json").read_text())
    text = stem.with_name(stem.name + ".md").read_text()
    summary, meta, (row,) = results["summary"], results["meta"], results["questions"]
    assert (summary["members"], summary["questions"], row["members"]) == (bench.QUICK["members"], 1, bench.QUICK["members"])
    assert summary["verdict"] == bench.verdict(summary["ratio"]) and summary["ratio"] == row["ratio"] > 0
    assert row["member_tokens"][0] > row["plain_tokens"] > 0  # documents + instruction make members longer
    assert meta["random_weights"] == (which == "config only") and meta["dtype"] == "float32"
    quick = load_scenarios(DEFAULT_SCENARIOS)[: bench.QUICK["scenarios"]]
    assert meta["documents"] == sum(len(s["documents"]) for s in quick)
    assert meta["answer_tokens"] == bench.QUICK["answer_tokens"]
    assert bench.target_line(summary) in text
    assert ("random weights (seed 0)" in text) == (which == "config only")
