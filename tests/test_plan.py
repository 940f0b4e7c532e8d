"""From the typed config and a model shape to the releases and the privacy statement."""

import math

import pytest
import torch

from vllm_dp_plugin.attention.calibration_file import Calibration
from vllm_dp_plugin.attention.mapping import HeadMapping
from vllm_dp_plugin.config import ConfigError, DPPrivacyConfig
from vllm_dp_plugin.plan import ContextPlan, ModelShape, context_reports

BOUNDS = {"key_bound": 0.5, "query_bound": 0.5, "value_bound": 1.0, "key_norm": 1.5, "query_norm": 1.5}


def _plan(layers=3, kv_heads=2, head_dim=8, **attention):
    cfg = DPPrivacyConfig.from_dict({"attention": {"epsilon": 4.0, "delta": 1e-6, "gate": False, **attention}}).attention
    return ContextPlan(cfg, "self_attention", layers, kv_heads, 2 * kv_heads, head_dim, head_dim**-0.5, 50)


def test_whole_model_spends_the_configured_budget_over_layers_x_heads():
    report = _plan(bounds=BOUNDS).report()
    assert report["releases"] == 6
    assert report["spent"]["epsilon"] == pytest.approx(4.0, rel=1e-6)
    assert report["spent"]["delta"] <= 1e-6
    assert report["per_release"]["epsilon"] < 4.0


def test_basic_composition_splits_epsilon_evenly():
    report = _plan(bounds=BOUNDS, composition="basic").report()
    assert report["per_release"]["epsilon"] == pytest.approx(4.0 / 6)
    assert report["spent"]["epsilon"] == pytest.approx(4.0)


def test_degree_rule_is_capped_by_max_features_and_the_kernel_error_reported():
    plan = _plan(bounds=BOUNDS, kernel_error=1e-9, max_features=200)
    degree = plan.layer_params(0).degree
    assert math.comb(8 + degree, degree) <= 200 < math.comb(8 + degree + 1, degree + 1)
    assert plan.kernel_error(0) > 1e-9  # honest: the cap costs accuracy, and it is stated


def test_public_bounds_are_required():
    with pytest.raises(ConfigError, match="needs public bounds"):
        _plan().layer(0, None)


def test_calibration_for_another_softmax_scale_is_refused(tmp_path):
    mapping = HeadMapping(0.5, 1.0, 1.0, 1.0, key_center=torch.zeros(2, 8, dtype=torch.float64))
    path = Calibration("m", "test", 0.999, 10, {"self_attention": {0: mapping}, "cross_attention": {}}).to_file(
        tmp_path / "cal.json"
    )
    with pytest.raises(ConfigError, match="calibrated with softmax scale 0.5"):
        _plan(layers=1, calibration=str(path)).report()


@pytest.mark.parametrize(
    "attention",
    [
        {},
        {"composition": "basic"},
        {"composition": "advanced"},
        {"composition": "rdp"},
        {"mechanism": "truncated_laplace"},
        {"mechanism": "truncated_laplace", "composition": "advanced"},
        {"mode": "tree", "degree": 1},
        {"mode": "tree", "degree": 1, "composition": "advanced"},
        {"mode": "tree", "degree": 1, "releases_per_head": 2},
        {"releases_per_head": 3},
    ],
    ids=repr,
)
def test_every_mode_states_a_finite_spend_within_the_budget(attention):
    """Gaussian states under advanced composition used to report eps = inf (no slack left above
    k delta); the DPTree used to spend its slack delta' (1e-6 per head) on top of the budget."""
    report = _plan(bounds=BOUNDS, **attention).report()
    per_head = attention.get("releases_per_head", 1)
    assert report["releases"] == 6 and report["planned"]["releases"] == 6 * per_head
    planned, spent = report["planned"], report["spent"]
    assert math.isfinite(spent["epsilon"]) and planned["epsilon"] <= 4.0 * (1 + 1e-6)
    assert planned["delta"] <= 1e-6 and spent["delta"] <= planned["delta"]
    if "mode" not in attention:  # the state spends its whole budget
        assert planned["epsilon"] == pytest.approx(4.0, rel=1e-2)


def test_each_layer_is_accounted_with_its_own_release(tmp_path):
    """Per-layer calibrations give per-layer releases: all of them are composed, not layer 0's."""
    tight = HeadMapping(8**-0.5, 0.2, 0.2, 0.5, key_center=torch.zeros(2, 8, dtype=torch.float64))
    loose = HeadMapping(8**-0.5, 2.0, 2.0, 2.0, key_center=torch.zeros(2, 8, dtype=torch.float64))
    path = Calibration("m", "test", 0.999, 10, {"self_attention": {0: tight, 1: loose}, "cross_attention": {}}).to_file(
        tmp_path / "cal.json"
    )
    plan = _plan(layers=2, calibration=str(path), mode="tree")
    degrees = plan.report()["taylor_degree"]
    assert degrees[0] != degrees[1]  # the degree rule differs: so do the DPTree's feature counts
    first, second = plan.mechanisms
    assert first.name != second.name
    assert plan.report()["per_release"]["mechanism"] == f"{first.name}, {second.name}"
    assert plan.report()["noise_std"][0] != plan.report()["noise_std"][1]


def test_config_shape_keys_must_match_the_model():
    with pytest.raises(ConfigError, match="attention.num_kv_heads is 4 but the served model has 2"):
        _plan(bounds=BOUNDS, num_kv_heads=4)
    with pytest.raises(ConfigError, match="exceeds max_context=10"):
        _plan(bounds=BOUNDS, max_context=10)


# --------------------------------------------------------------------------- DP aggregation
def test_aggregate_report_states_the_calibrated_query_and_the_ledger(tmp_path):
    from vllm_dp_plugin.plan import aggregate_report, aggregation_params
    from vllm_dp_plugin.privacy.accountant import Budget
    from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
    from vllm_dp_plugin.privacy.query_ledger import QueryLedger
    from vllm_dp_plugin.reports import aggregate_statement, aggregate_text

    agg = DPPrivacyConfig.from_dict({"aggregate": {"contexts": {"docs": "d.jsonl"}, "epsilon": 4.0,
                                                   "max_epsilon": 8.0}}).aggregate
    params = aggregation_params(agg)
    assert params.worst_case.epsilon <= 4.0 * (1 + 1e-9)
    assert params.worst_case.epsilon == pytest.approx(4.0, rel=1e-4)
    assert aggregation_params(agg, 8.0).worst_case.epsilon == pytest.approx(8.0, rel=1e-4)
    with pytest.raises(ValueError, match="dp_epsilon"):
        aggregation_params(agg, 9.0)
    ledger = QueryLedger(NoiseKey(tmp_path / "k"), tmp_path / "q.jsonl")
    total = Budget(agg.total_epsilon, agg.total_delta)
    ledger.settle(ledger.reserve("docs", total, params.worst_case), Budget(1.5, 0.0))
    statement = aggregate_statement(agg, ledger)
    (report,) = statement["contexts"]
    assert report == {**aggregate_report(agg, "docs", ledger.status("docs", total))}
    assert report["unit"].startswith("one document") and report["candidates"] == "the whole vocabulary"
    assert report["ledger"]["spent"]["epsilon"] == pytest.approx(1.5) and report["ledger"]["queries"] == 1
    text = aggregate_text(report)
    assert "one document" in text and "spent so far: (eps=1.5" in text


def test_aggregate_statement_protects_which_documents_exist_and_states_replace_one():
    """Add/remove neighbours differ exactly in which documents exist and how many: the unit says it
    covers that (up to one document) and what a replacement is; the public part is the
    configuration, not the collection (it said "which documents exist and how many" before the side-channel review of DP aggregation)."""
    from vllm_dp_plugin.plan import aggregate_report

    agg = DPPrivacyConfig.from_dict({"aggregate": {"contexts": {"docs": "d.jsonl"}}}).aggregate
    report = aggregate_report(agg, "docs", None)
    assert "presence" in report["unit"] and "number of documents up to one" in report["unit"]
    assert "a replacement is two such changes" in report["unit"]
    assert "which documents" not in report["not_protected"] and "how many" not in report["not_protected"]
    assert all(key in report["not_protected"] for key in ("members", "max_document_tokens", "max_member_tokens"))


@pytest.mark.parametrize("grouped", [None, 16])
def test_answer_members_calibrate_for_two_keys_per_document_at_the_stated_epsilon(grouped):
    """One member per document: one vote comes or goes (l0 = 1). Grouped members
    (``answer_members``): a document can switch its member's vote from one key to another, two
    counts move (l0 = 2): scale 2 / eps, and the statement says so, at the same stated eps."""
    from vllm_dp_plugin.plan import aggregate_report, aggregation_params

    agg = DPPrivacyConfig.from_dict({"aggregate": {"contexts": {"docs": "d.jsonl"}, "mechanism": "answer",
                                                   "epsilon": 4.0, "answer_members": grouped}}).aggregate
    l0 = 1 if grouped is None else 2
    release = aggregation_params(agg).release
    assert release.l0 == l0 and release.scale == pytest.approx(l0 / 4.0)
    assert release.budget.epsilon == pytest.approx(4.0) and release.budget.delta <= agg.delta
    report = aggregate_report(agg, "docs", None)
    assert report["selection"]["keys_per_document"] == l0
    assert report["per_query"]["worst_case"]["epsilon"] == pytest.approx(4.0)
    assert ("one vote per document" in report["statement"]) == (grouped is None)


def test_a_request_below_the_minimum_epsilon_is_refused_naming_it():
    from vllm_dp_plugin.plan import aggregation_params

    agg = DPPrivacyConfig.from_dict({"aggregate": {"contexts": {"docs": "d.jsonl"}, "epsilon": 4.0,
                                                   "min_epsilon": 0.5}}).aggregate
    for eps in (0.4999, 1e-9, 1e-300, 0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"dp_epsilon must lie in \[0.5, 4\] \(aggregate.min_epsilon, "
                                             r"aggregate.max_epsilon\)"):
            aggregation_params(agg, eps)
    assert aggregation_params(agg, 0.5).worst_case.epsilon == pytest.approx(0.5, rel=1e-4)
    assert aggregation_params(agg, 0.5).min_charge == 0.5


def test_aggregate_statement_states_the_minimum_and_each_clients_share_never_its_key(tmp_path):
    import hashlib
    import json

    from vllm_dp_plugin.privacy.accountant import Budget
    from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
    from vllm_dp_plugin.privacy.query_ledger import QueryLedger
    from vllm_dp_plugin.reports import aggregate_statement, aggregate_text

    digests = {name: hashlib.sha256(f"sk-{name}".encode()).hexdigest() for name in ("alice", "bob")}
    agg = DPPrivacyConfig.from_dict({"aggregate": {
        "contexts": {"docs": "d.jsonl", "wiki": "w.jsonl"}, "epsilon": 4.0, "total_epsilon": 100.0,
        "clients": {"alice": {"api_key_sha256": digests["alice"], "share": 0.25},
                    "bob": {"api_key_sha256": digests["bob"], "share": 1.0}}}}).aggregate
    (report, _) = aggregate_statement(agg, None)["contexts"]
    assert report["per_query"]["min_epsilon"] == 0.5 and report["max_queries"] == 200
    assert report["clients"] == {"alice": {"share": 0.25, "budget": {"epsilon": 25.0, "delta": 2.5e-5}},
                                 "bob": {"share": 1.0, "budget": {"epsilon": 100.0, "delta": 1e-4}}}
    ledger = QueryLedger(NoiseKey(tmp_path / "k"), tmp_path / "q.jsonl")
    total = Budget(100.0, 1e-4)
    alice = agg.client_for_key("sk-alice")
    ledger.settle(ledger.reserve("docs", total, Budget(4.0, 0.0), alice.quota), Budget(1.5, 0.0))
    statement = aggregate_statement(agg, ledger)
    docs, wiki = statement["contexts"]
    assert docs["clients"]["alice"]["ledger"]["spent"] == {"epsilon": 1.5, "delta": 0.0}
    assert docs["clients"]["alice"]["ledger"]["remaining"] == {"epsilon": 23.5, "delta": 2.5e-5}
    assert docs["clients"]["bob"]["ledger"]["queries"] == 0 and docs["ledger"]["queries"] == 1
    assert wiki["clients"]["alice"]["ledger"]["queries"] == 0
    dumped = json.dumps(statement)
    assert not any(d in dumped or d.upper() in dumped for d in digests.values()) and "sk-" not in dumped
    text = aggregate_text(docs)
    assert "requests may ask for 0.5 to 4" in text and "charged at least eps 0.5" in text
    assert "at most 200 queries" in text
    assert "client 'alice': share 0.25 of the budget, (eps=25, delta=2.5e-05); spent (eps=1.5" in text
    assert "client 'bob': share 1 of the budget" in text


# ----------------------------------------------------------------------------- the public gate
def test_relative_error_bound_is_kernel_error_plus_noise_over_the_smallest_denominator():
    plan = _plan(bounds=BOUNDS)
    layer = plan.layer(0, plan._one_head)._dp
    sigma = math.sqrt(plan.mechanisms[0].variance)
    t = layer.logit_bound
    norm = layer.features.norm_bound(layer.mapping.query_bounds(8))
    direct = plan.kernel_error(0) + sigma * norm / (50 * math.exp(-t))
    assert plan.relative_errors[0] == pytest.approx(direct, rel=1e-12)


def test_the_gate_opens_exactly_the_layers_whose_public_bound_meets_it_and_spends_only_for_them():
    errors = _plan(bounds=BOUNDS).relative_errors  # the same for every layer here (same bounds)
    shut = _plan(bounds=BOUNDS, gate=errors[0] * 0.99)
    assert shut.open_layers == (False,) * 3 and shut.spent().epsilon == 0
    report = shut.report()
    assert report["releases"] == 0 and report["regime"].startswith("out of regime")
    assert "nothing is spent" in report["regime"]
    opened = _plan(bounds=BOUNDS, gate=errors[0] * 1.01)
    assert opened.open_layers == (True,) * 3
    assert opened.spent().epsilon == pytest.approx(_plan(bounds=BOUNDS).spent().epsilon)
    assert opened.report()["regime"].startswith("in regime")
    assert _plan(bounds=BOUNDS).report()["regime"].startswith("gate off")


def test_a_closed_layer_never_holds_exact_rows_nor_answers():
    plan = _plan(bounds=BOUNDS, gate=1e-12)
    layer = plan.layer(0, plan._one_head)
    assert not layer.open
    layer.collect(torch.arange(50), torch.ones(50, 1, 8), torch.ones(50, 1, 8))
    assert layer._k.numel() == 0 and not layer.complete
    with pytest.raises(RuntimeError, match="not released"):
        layer.answer(torch.ones(3, 2, 8))


def test_the_gate_reads_public_quantities_only():
    """Two plans from the same configuration and shape gate alike whatever the context's
    contents: the plan never sees a token or a K/V row (its inputs are config, shape, n)."""
    import inspect

    params = set(inspect.signature(ContextPlan).parameters)
    assert params == {"cfg", "kind", "layers", "total_kv_heads", "total_query_heads", "head_dim", "beta",
                      "context_len", "public_head"}


def test_cross_attention_is_never_gated():
    cfg = DPPrivacyConfig.from_dict({"attention": {"epsilon": 4.0, "delta": 1e-6, "bounds": BOUNDS,
                                                   "gate": 1e-12}}).attention
    plan = ContextPlan(cfg, "cross_attention", 2, 2, 4, 8, 8**-0.5, 50)
    assert plan.open_layers == (True, True) and plan.regime().startswith("no gate")


def test_a_release_that_cannot_fit_its_memory_limit_is_refused_before_serving():
    plan = _plan(bounds=BOUNDS, mode="tree", degree=2)
    plan.check_memory()  # 50 rows fit
    assert plan.memory_refusal() is None
    # Whisper: ``context_reports`` (every worker's start-up statement, ``vllm-dp account``) refuses
    # an encoder output (tiny.en's shape: 1500 rows) whose tree table exceeds the cap, naming the
    # keys to change and the sizes (degree 1 fits: tests/benchmarks/test_whisper_bench.py)
    tiny_en = ModelShape(4, 4, 6, 6, 64, 64**-0.5, True, 1500)
    tree = {"epsilon": 8.0, "delta": 1e-6, "mode": "tree", "bounds": BOUNDS}
    with pytest.raises(ConfigError) as refused:
        context_reports(DPPrivacyConfig.from_dict({"attention": {**tree, "degree": 2}}).attention, tiny_en, {})
    assert str(refused.value) == (
        "attention.mode: tree needs ~19.15 GiB for layer 0's release of 1500 rows (Taylor degree 2, 2145 features) "
        "> memory_limit_bytes=16.00 GiB per layer release (fixed); use attention.mode: state or a lower "
        "attention.degree")
