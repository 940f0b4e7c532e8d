"""The typed dp_privacy config and the `vllm-dp account` command (without a model; with one:
tests/serving/test_budget_statement.py)."""

import dataclasses
import hashlib
import re

import pytest
import yaml

from vllm_dp_plugin.attention.params import DPAttentionParams
from vllm_dp_plugin.cli import main
from vllm_dp_plugin.config import (
    AttentionPrivacyConfig,
    ConfigError,
    DPPrivacyConfig,
    parse_section,
    section_from_file,
    section_json,
)
from vllm_dp_plugin.plan import SHARED_FIELDS, attention_params

GOOD = {"attention": {"epsilon": 8.0, "delta": 1e-6, "num_layers": 2, "num_kv_heads": 2}}


def test_defaults():
    cfg = DPPrivacyConfig.from_dict(GOOD)
    att = cfg.attention
    assert cfg.enabled and att.mode == "state" and att.mechanism == "gaussian"
    assert att.composition == "pld" and (att.num_layers, att.num_kv_heads, att.releases_per_head) == (2, 2, 1)


def test_config_and_attention_params_share_names_and_defaults():
    """The one translation copies every shared field: none may drift in name or default."""
    config = {f.name: f.default for f in dataclasses.fields(AttentionPrivacyConfig)}
    params = {f.name: f.default for f in dataclasses.fields(DPAttentionParams)}
    knobs = ("mode", "mechanism", "composition", "features", "degree", "kernel_error", "max_features",
             "num_random_features", "max_context")
    assert set(knobs) <= set(SHARED_FIELDS) == set(config) & set(params)
    assert {name: config[name] for name in SHARED_FIELDS if name not in ("epsilon", "delta")} == {
        name: params[name] for name in SHARED_FIELDS if name not in ("epsilon", "delta")}
    att = DPPrivacyConfig.from_dict({"attention": {"epsilon": 2.0, "delta": 1e-7, "mechanism": "truncated_laplace",
                                                   "kernel_error": 0.2, "max_context": 99}}).attention
    params = attention_params(att, 6)
    assert all(getattr(params, name) == getattr(att, name) for name in SHARED_FIELDS)
    assert params.scope == "layer"


def test_the_section_is_parsed_once_per_process():
    raw = {"attention": {"epsilon": 1, "delta": "1e-6", "contexts": {"b": "b.txt", "a": "a.txt"}}}
    first = parse_section(raw)
    assert parse_section(dict(raw)) is first and first.attention.delta == 1e-6
    reordered = {"attention": {**raw["attention"], "contexts": {"a": "a.txt", "b": "b.txt"}}}
    assert list(parse_section(reordered).attention.context_files()) == ["a", "b"]  # order is meaning
    assert parse_section(None) is parse_section({}) and not parse_section(None).enabled
    for _ in range(2):  # errors are not cached away
        with pytest.raises(ConfigError, match="attention.epsilon must be > 0"):
            parse_section({"attention": {"epsilon": -1, "delta": 1e-6}})
    with pytest.raises(ConfigError, match="plain JSON values"):
        section_json({"attention": {"epsilon": object()}})


def test_empty_config_means_dp_off():
    assert not DPPrivacyConfig.from_dict({}).enabled


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"atention": {}}, r"unknown key\(s\) \['atention'\]"),
        ({"attention": {"epsilon": 1.0}}, r"missing required key\(s\) \['delta'\]"),
        ({"attention": {**GOOD["attention"], "epsilon": 0}}, "epsilon must be > 0"),
        ({"attention": {**GOOD["attention"], "epsilon": float("nan")}}, "epsilon must be finite"),
        ({"attention": {**GOOD["attention"], "delta": 1.0}}, r"delta must lie in \(0, 1\)"),
        ({"attention": {**GOOD["attention"], "mechanism": "cauchy"}}, "attention.mechanism"),
        ({"attention": {**GOOD["attention"], "mode": "magic"}}, "attention.mode"),
        ({"attention": {**GOOD["attention"], "num_layers": 0}}, "num_layers"),
        ({"attention": {**GOOD["attention"], "mechanism": "truncated_laplace", "composition": "rdp"}},
         "attention.composition rdp accounts the Gaussian state only"),
        ({"attention": {**GOOD["attention"], "mode": "tree", "composition": "rdp"}}, "attention.composition rdp"),
        ({"attention": {**GOOD["attention"], "mode": "reference"}}, "attention.mode"),
        ({"attention": {**GOOD["attention"], "colour": "red"}}, "unknown key"),
        ({"attention": [1, 2]}, "must be a mapping"),
    ],
)
def test_bad_config_names_the_key(raw, match):
    with pytest.raises(ConfigError, match=match):
        DPPrivacyConfig.from_dict(raw)


def test_account_of_dp_attention_needs_the_served_model(tmp_path, capsys):
    path = tmp_path / "dp.yaml"
    path.write_text(yaml.safe_dump({"dp_privacy": GOOD}))
    assert main(["account", "--config", str(path)]) == 2
    assert "pass --model MODEL" in capsys.readouterr().err


def test_account_of_nothing_says_dp_is_off(tmp_path, capsys):
    path = tmp_path / "dp.yaml"
    path.write_text(yaml.safe_dump({"dp_privacy": {}}))
    assert main(["account", "--config", str(path)]) == 0
    assert "DP is off" in capsys.readouterr().out


def test_file_paths_are_relative_to_the_config_file(tmp_path):
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "dp.yaml"
    path.write_text(yaml.safe_dump({"dp_privacy": {"key_file": "k", "attention": {
        "epsilon": 1.0, "delta": 1e-6, "calibration": "../cal.json", "contexts": {"a": "a.txt"}}}}))
    raw = section_from_file(path)
    base = (tmp_path / "conf").resolve()
    assert raw["key_file"] == str(base / "k") and raw["attention"]["calibration"] == str(base / "../cal.json")
    assert raw["attention"]["contexts"] == {"a": str(base / "a.txt")}


@pytest.mark.parametrize(
    "prompt,expect",
    [
        ({"epsilon": 12.0}, "trlap_corrected: (12, 1e-06)-DP per token"),
        ({"mechanism": "trlap_paper"}, "the claimed delta is NOT valid"),
        ({"mechanism": "cmp", "epsilon": 3.0}, "metric DP, eps = 3 per unit embedding distance"),
        ({"mechanism": "paraphrase", "epsilon": 30.0}, "over the cap of 32 output tokens): (960, 0)"),
    ],
)
def test_account_command_states_prompt_privatization(tmp_path, capsys, prompt, expect):
    path = tmp_path / "dp.yaml"
    path.write_text(yaml.safe_dump({"dp_privacy": {"prompt": prompt}}))
    assert main(["account", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Prompt privatization of user-authored tokens" in out and expect in out
    assert "DP is off" not in out and "DP attention" not in out


def test_account_of_aggregation_states_the_minimum_and_the_client_shares(tmp_path, capsys):
    digest = hashlib.sha256(b"sk-alice").hexdigest()
    path = tmp_path / "dp.yaml"
    path.write_text(yaml.safe_dump({"dp_privacy": {"key_file": "noise.key", "aggregate": {
        "contexts": {"docs": "docs.jsonl"}, "min_epsilon": 2.0,
        "clients": {"alice": {"api_key_sha256": digest, "share": 0.5}}}}}))
    assert main(["account", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "requests may ask for 2 to 8); every query is charged at least eps 2" in out
    assert "at most 100 queries" in out
    assert "client 'alice': share 0.5 of the budget, (eps=100, delta=5e-05)" in out
    assert digest not in out and not (tmp_path / "noise.key").exists()  # account never creates a key


def test_account_command_bad_config_exits_2(tmp_path, capsys):
    path = tmp_path / "dp.yaml"
    path.write_text(yaml.safe_dump({"dp_privacy": {"attention": {"epsilon": -1, "delta": 1e-6}}}))
    assert main(["account", "--config", str(path)]) == 2
    assert "epsilon must be > 0" in capsys.readouterr().err


def test_example_config_is_valid():
    cfg = DPPrivacyConfig.from_file("examples/dp.yaml")
    att = cfg.attention
    assert (att.mode, att.mechanism, att.epsilon, att.delta, att.composition) == ("state", "gaussian", 8.0, 1e-6, "pld")
    assert (att.num_layers, att.num_kv_heads) == (None, None)  # read from the model


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"bounds": {"key_bound": 1.0}}, r"bounds: missing required key\(s\) \['query_bound', 'value_bound'\]"),
        ({"bounds": {"key_bound": 1, "query_bound": 1, "value_bound": -1}}, "bounds.value_bound must be > 0"),
        ({"bounds": {"key_bound": 1, "query_bound": 1, "value_bound": 1, "k": 2}}, r"unknown key\(s\) \['k'\]"),
        ({"calibration": "c.json", "bounds": {"key_bound": 1, "query_bound": 1, "value_bound": 1}}, "not both"),
        ({"epsilon": 1e4}, "beyond what pld accounting handles"),
        ({"features": "fourier"}, "attention.features"),
    ],
)
def test_serving_keys_are_validated(extra, match):
    with pytest.raises(ConfigError, match=match):
        DPPrivacyConfig.from_dict({"attention": {**GOOD["attention"], **extra}})


def test_huge_epsilon_is_fine_with_basic_composition():
    cfg = DPPrivacyConfig.from_dict({"attention": {**GOOD["attention"], "epsilon": 1e6, "composition": "basic"}})
    assert cfg.attention.epsilon == 1e6


def test_prompt_section_defaults_and_switches():
    cfg = DPPrivacyConfig.from_dict({"prompt": {}})
    p = cfg.prompt
    assert cfg.prompt_enabled and not cfg.enabled  # the attention backend stays a pass-through
    assert (p.mechanism, p.epsilon, p.delta, p.mode, p.fast_dtype) == ("trlap_corrected", 10.0, 1e-6, "tokens", "auto")
    assert (p.center, p.clip_quantile, p.topk, p.allow_request_override, p.cache_history) == (True, 0.5, 32, True, True)
    assert p.max_epsilon is None and p.effective_dim is None
    both = DPPrivacyConfig.from_dict({**GOOD, "prompt": {"mechanism": "expmech", "epsilon": 3}})
    assert both.enabled and both.prompt_enabled and both.prompt.mechanism == "expmech"
    assert not DPPrivacyConfig.from_dict(GOOD).prompt_enabled


@pytest.mark.parametrize(
    "prompt,match",
    [
        ({"mechanism": "gauss"}, "prompt.mechanism must be one of"),
        ({"epsilon": 0}, "prompt.epsilon must be > 0"),
        ({"delta": 1.5}, r"prompt.delta must lie in \(0, 1\)"),
        ({"epsilon": 20, "max_epsilon": 5}, "prompt.epsilon=20 exceeds prompt.max_epsilon=5"),
        ({"max_epsilon": -1}, "prompt.max_epsilon must be > 0"),
        ({"clip_quantile": 0}, "prompt.clip_quantile must be > 0"),
        ({"clip_quantile": 1.5}, r"prompt.clip_quantile must lie in \(0, 1\]"),
        ({"topk": 0}, "prompt.topk must be an integer >= 1"),
        ({"effective_dim": 0}, "prompt.effective_dim must be an integer >= 1"),
        ({"fast_dtype": "float16"}, "prompt.fast_dtype must be one of"),
        ({"search_device": "tpu"}, "prompt.search_device must be one of"),
        ({"mode": "logits"}, "prompt.mode must be one of"),
        ({"cache_history": "yes"}, "prompt.cache_history must be true or false"),
        ({"paraphrase_width": 0}, "prompt.paraphrase_width must be > 0"),
        ({"paraphrase_max_tokens": 0}, "prompt.paraphrase_max_tokens must be an integer >= 1"),
        ({"paraphrase_template": "no placeholder"}, "prompt.paraphrase_template: .*exactly once"),
        ({"mechanism": "paraphrase", "mode": "embeddings"}, "paraphrase rewrites text: it needs prompt.mode tokens"),
        ({"eps": 1}, r"dp_privacy.prompt: unknown key\(s\) \['eps'\]"),
        ([1], "dp_privacy.prompt must be a mapping"),
    ],
)
def test_bad_prompt_config_names_the_key(prompt, match):
    with pytest.raises(ConfigError, match=match):
        DPPrivacyConfig.from_dict({"prompt": prompt})


# --------------------------------------------------------------------------- aggregate section
def _aggregate(**fields):
    return DPPrivacyConfig.from_dict({"aggregate": {"contexts": {"docs": "docs.jsonl"}, **fields}}).aggregate


def test_aggregate_defaults_are_the_recommended_settings():
    agg = _aggregate()
    assert (agg.mechanism, agg.members, agg.epsilon, agg.gate, agg.max_private_tokens) == ("vote", 8, 8.0, "svt", 4)
    assert agg.choices is None and _aggregate(mechanism="expmech").choices == 64
    assert agg.cap == 8.0 and _aggregate(max_epsilon=16.0).cap == 16.0
    assert _aggregate(gate="none").gate_fraction == 0.0 and agg.gate_fraction == 0.5
    assert agg.allow_foreign_ledger is False and _aggregate(allow_foreign_ledger=True).allow_foreign_ledger is True


@pytest.mark.parametrize(("fields", "key"), [
    ({"mechanism": "median"}, "aggregate.mechanism"),
    ({"gate": "maybe"}, "aggregate.gate"),
    ({"members": 0}, "aggregate.members"),
    ({"epsilon": 10.0, "max_epsilon": 5.0}, "aggregate.max_epsilon"),
    ({"epsilon": 300.0}, "aggregate.total_epsilon"),
    ({"delta": 1e-3}, "aggregate.total_delta"),
    ({"gate_share": 1.0}, "aggregate.gate_share"),
    ({"gate_share": 0.0}, "aggregate.gate_share"),
    ({"threshold": -0.1}, "aggregate.threshold"),
    ({"confidence": 1.5}, "aggregate.confidence"),
    ({"candidates": 0}, "aggregate.candidates"),
    ({"contexts": {"bad name": "x.jsonl"}}, "aggregate.contexts"),
    ({"contexts": {}}, "aggregate.contexts"),
    ({"contexts": 3}, "aggregate.contexts"),
    ({"budget_file": 3}, "aggregate.budget_file"),
    ({"allow_foreign_ledger": "yes"}, "aggregate.allow_foreign_ledger"),
    ({"allow_foreign_ledger": 1}, "aggregate.allow_foreign_ledger"),
])
def test_aggregate_errors_name_the_key(fields, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _aggregate(**fields)


ALICE_KEY, BOB_KEY = "sk-alice-0123", "sk-bob-4567"
ALICE_SHA = hashlib.sha256(ALICE_KEY.encode()).hexdigest()
BOB_SHA = hashlib.sha256(BOB_KEY.encode()).hexdigest()


def test_aggregate_min_epsilon_defaults_to_an_eighth_of_the_query_and_is_validated():
    assert _aggregate().min_epsilon == 1.0  # 200 / 1 = 200 queries at most per collection
    assert _aggregate(epsilon=2.0, total_epsilon=50).min_epsilon == 0.25
    assert _aggregate(min_epsilon="1e-2").min_epsilon == 0.01  # YAML's 1e-2 is a string
    assert _aggregate(min_epsilon=8.0).min_epsilon == 8.0  # every query at the default
    for value, why in ((0, "must be > 0"), (-1.0, "must be > 0"), (float("inf"), "finite"), ("x", "min_epsilon"),
                       (8.5, "exceeds aggregate.epsilon=8"), (True, "min_epsilon")):
        with pytest.raises(ConfigError, match="aggregate.min_epsilon") as info:
            _aggregate(min_epsilon=value)
        assert why in str(info.value)


def test_aggregate_clients_are_parsed_and_a_bearer_key_names_its_client():
    agg = _aggregate(clients={"alice": {"api_key_sha256": ALICE_SHA.upper(), "share": 0.25},
                              "bob": {"api_key_sha256": BOB_SHA, "share": 1}})
    assert list(agg.clients) == ["alice", "bob"]
    alice = agg.clients["alice"]
    assert (alice.name, alice.api_key_sha256, alice.share) == ("alice", ALICE_SHA, 0.25)
    assert alice.quota.client == "alice" and alice.quota.share == 0.25
    assert agg.client_for_key(ALICE_KEY) is alice and agg.client_for_key(BOB_KEY) is agg.clients["bob"]
    assert agg.client_for_key("sk-mallory") is None and agg.client_for_key(ALICE_SHA) is None
    assert _aggregate().clients == {} and _aggregate().client_for_key(ALICE_KEY) is None


@pytest.mark.parametrize(("clients", "why"), [
    (["alice"], "non-empty mapping"),
    ({}, "non-empty mapping"),
    ({"a b": {"api_key_sha256": ALICE_SHA, "share": 0.5}}, "client name 'a b'"),
    ({"alice": {"api_key_sha256": ALICE_SHA}}, "aggregate.clients.alice must be a mapping with exactly"),
    ({"alice": {"api_key_sha256": ALICE_SHA, "share": 0.5, "key": ALICE_KEY}}, "exactly the keys"),
    ({"alice": {"api_key_sha256": ALICE_KEY, "share": 0.5}}, r"aggregate.clients.alice.api_key_sha256 must be the 64"),
    ({"alice": {"api_key_sha256": ALICE_SHA, "share": 0}}, r"aggregate.clients.alice.share must lie in \(0, 1\]"),
    ({"alice": {"api_key_sha256": ALICE_SHA, "share": 1.5}}, r"alice.share must lie in \(0, 1\]"),
    ({"alice": {"api_key_sha256": ALICE_SHA, "share": True}}, r"alice.share must lie in \(0, 1\]"),
    ({"alice": {"api_key_sha256": ALICE_SHA, "share": 0.001}}, "cannot pay for one query of aggregate.min_epsilon=1"),
    ({"alice": {"api_key_sha256": ALICE_SHA, "share": 0.5}, "bob": {"api_key_sha256": ALICE_SHA, "share": 0.5}},
     "aggregate.clients.bob.api_key_sha256 is another client's too"),
])
def test_aggregate_clients_errors_name_the_key(clients, why):
    with pytest.raises(ConfigError, match="aggregate.clients") as info:
        _aggregate(clients=clients)
    assert re.search(why, str(info.value)), str(info.value)


def test_aggregate_excludes_attention_and_prompt():
    base = {"aggregate": {"contexts": {"docs": "d.jsonl"}}}
    with pytest.raises(ConfigError, match="not attention and aggregate"):
        DPPrivacyConfig.from_dict({**base, "attention": {"epsilon": 1.0, "delta": 1e-6}})
    with pytest.raises(ConfigError, match="`prompt`"):
        DPPrivacyConfig.from_dict({**base, "prompt": {}})


def test_aggregate_directory_of_collections(tmp_path):
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "a.jsonl").write_text('{"text": "y"}\n')
    agg = DPPrivacyConfig.from_dict({"aggregate": {"contexts": str(tmp_path)}}).aggregate
    assert list(agg.collection_sources()) == ["a", "b"]
    with pytest.raises(ConfigError, match="no .jsonl collections"):
        DPPrivacyConfig.from_dict({"aggregate": {"contexts": str(tmp_path / "none")}}).aggregate.collection_sources()


def test_aggregate_paths_resolve_relative_to_the_file(tmp_path):
    (tmp_path / "dp.yaml").write_text("aggregate:\n  contexts: {docs: docs.jsonl}\n  budget_file: q.jsonl\n")
    raw = section_from_file(tmp_path / "dp.yaml")
    assert raw["aggregate"]["contexts"] == {"docs": str(tmp_path / "docs.jsonl")}
    assert raw["aggregate"]["budget_file"] == str(tmp_path / "q.jsonl")


@pytest.mark.parametrize("value", ["first", -1, 1.5, True])
def test_public_head_must_be_auto_or_a_count(value):
    with pytest.raises(ConfigError, match="attention.public_head"):
        DPPrivacyConfig.from_dict({"attention": {"epsilon": 1.0, "delta": 1e-6, "public_head": value}})


@pytest.mark.parametrize("value", [0, -0.5, True, float("inf"), "on"])
def test_gate_must_be_a_positive_error_or_false(value):
    with pytest.raises(ConfigError, match="attention.gate"):
        DPPrivacyConfig.from_dict({"attention": {"epsilon": 1.0, "delta": 1e-6, "gate": value}})


def test_public_head_and_gate_defaults():
    att = DPPrivacyConfig.from_dict({"attention": {"epsilon": 1.0, "delta": 1e-6}}).attention
    assert (att.public_head, att.gate) == ("auto", 0.5)
    off = DPPrivacyConfig.from_dict({"attention": {"epsilon": 1.0, "delta": 1e-6, "gate": False, "public_head": 0}})
    assert (off.attention.public_head, off.attention.gate) == (0, False)
