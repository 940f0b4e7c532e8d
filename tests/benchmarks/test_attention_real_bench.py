"""`python -m benchmarks.attention_real` on a tiny random Llama: the capture reproduces the model's own
attention, the exact path is exact, an in-regime DP part is close, and the report has its shape."""

import json
import math

import pytest
import torch

from benchmarks import SUITES
from benchmarks.attention_real import build_parser, run
from benchmarks.attention_real.capture import Captured, Hooked, prepare
from benchmarks.attention_real.measures import Sequences
from benchmarks.attention_real.parts import (
    Plans,
    causal_tail,
    conditions,
    keys_part,
    rel_sq,
)
from benchmarks.attention_real.report import markdown, plot
from vllm_dp_plugin.cli import BENCH_SUITES
from vllm_dp_plugin.plan import ModelShape

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 8
# small public bounds: T = beta * 1.5 * 1.5 ~ 0.8, Taylor degree 4 (in regime)
BOUNDS = {"key_bound": 1.0, "query_bound": 1.0, "value_bound": 2.0, "key_norm": 1.5, "query_norm": 1.5}
EPS = (8.0,)


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    prepare(model)
    return model


def sequences() -> list[Sequences]:
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(4, 64, (n,), generator=g).tolist()
    questions = [{"ids": ids(5), "answers": ["7"], "kind": kind, "q": f"q{i}"}
                 for i, kind in enumerate(("shared", "public"))]
    return [Sequences("s0", ids(24), 3, questions)]


@pytest.fixture(scope="module")
def result(model):
    shape = ModelShape(LAYERS, 0, KV_HEADS, HEADS, HEAD_DIM, HEAD_DIM**-0.5, False)
    seqs = sequences()
    plans = lambda s: Plans.of(shape, len(s.context), s.head, EPS, bounds=BOUNDS)
    return run(model, seqs, plans, EPS, answer_tokens=3, answers=True, seed=0, eos=None,
                     decode=lambda t: " ".join(map(str, t)), log=lambda _: None)


def test_capture_reproduces_the_models_attention(model):
    ids = torch.tensor([sequences()[0].context])
    capture = Captured()
    with torch.no_grad(), Hooked(capture):
        hooked = model(input_ids=ids).logits
    for layer in range(LAYERS):
        q, k, v = capture.q[layer], capture.k[layer], capture.v[layer]
        positions = torch.arange(ids.shape[1])
        exact = keys_part(q, k, v, capture.scale, causal_tail(positions, positions))
        err, ref = rel_sq(capture.out[layer], exact.out)
        assert math.sqrt(err / ref) < 1e-5
    # the registered attention is the model's own eager attention: outputs unchanged
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            stock = model(input_ids=ids).logits
    finally:
        prepare(model)
    assert torch.equal(hooked, stock)


def test_exact_path_is_exact_and_an_in_regime_dp_part_is_close(result):
    agg = result["aggregate"]
    assert agg["capture_rel_error"]["max"] < 1e-5
    assert agg["merged_rel_error"]["exact"]["max"] < 1e-12
    assert agg["merged_rel_error"]["kernel_head"]["max"] < 1e-3  # float32 queries, Taylor degree 4
    assert agg["head"]["out_rel_error"]["kernel"]["max"] < 1e-3
    assert agg["merged_rel_error"]["dropped"]["mean"] > 1e-2  # the private rows carry attention
    for row in result["layers"]:
        sinks = row["sinks"]
        assert sinks["mass_pos0"] <= sinks["mass_head"] + 1e-12
        assert sinks["mass_head"] + sinks["mass_private"] + sinks["mass_tail"] == pytest.approx(1.0)
        assert row["taylor_degree"] == 4 and row["noise_std"]["8"] > 0
        assert row["head"]["noise_to_denominator_median"]["8"] > 0
    e2e = {r["condition"]: r for r in result["end_to_end"]}
    assert e2e["full"]["agreement"] == e2e["exact"]["agreement"] == 1.0
    assert e2e["exact"]["kl"] < 1e-9
    answers = {(r["condition"], r["question"]): r["answer"] for r in result["end_to_end_rows"]}
    for qi in range(2):  # each condition's own greedy answer (cache cropped after teacher forcing)
        assert answers[("exact", qi)] == answers[("full", qi)]
        assert len(answers[("eps8_head", qi)]) == 3


def test_report_has_every_layer_condition_and_file(result, tmp_path):
    conds = [c.name for c in conditions(EPS)]
    assert result["conditions"] == conds == ["exact", "kernel_bare", "kernel_head", "eps8_head", "eps8_bare",
                                             "dropped"]
    assert [r["layer"] for r in result["layers"]] == list(range(LAYERS))
    for row in result["layers"]:
        assert set(row["merged_rel_error"]) == set(conds)
        for span in ("bare", "head"):
            assert set(row[span]["out_rel_error"]) == {"mapping", "kernel", "eps8"}
    assert [r["condition"] for r in result["end_to_end"]] == ["full", *conds]
    data = {**result, "model": "tiny", "device": "cpu-test", "date": "2026-11-26", "command": "test",
            "calibration": "bounds", "scenarios": "inline", "questions_per_scenario": 2, "answer_tokens": 3,
            "answers": True, "wall_s": 1.0}
    text = markdown(data)
    for needle in ("## 1. Sinks", "## 2./3. The DP part", "## 4. Merged attention output", "## End to end",
                   "| eps8_head |", "s0 P=24"):
        assert needle in text, needle
    assert plot(data, tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    json.dumps(data, default=str)


def test_registered_as_a_research_suite():
    assert "attention_real" in SUITES and "attention-real" not in BENCH_SUITES
    args = build_parser().parse_args(["--questions", "3,4", "--eps", "8,64"])
    assert args.questions == (3, 4) and args.eps == (8.0, 64.0)
