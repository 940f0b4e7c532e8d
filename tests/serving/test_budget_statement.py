"""One statement: `vllm-dp account` prints what `GET /v1/dp/budget` answers, for every mode.

Both come from ``settings.budget_statement`` (one ``ContextPlan.report()`` per private context):
the endpoint's ``budget_payload`` over a real ``VllmConfig`` (vLLM's ``EngineArgs``, no engine),
the command over the model's Hugging Face config. Their contexts must agree field by field
(less the endpoint's keyed label and ledger), and the text the command prints is rendered from
the same report. Also: what each mode spends stays within the configured budget, and
``releases_per_head`` is honoured by serving (each release gets its share).
"""

import contextlib
import io
import json

import pytest

from vllm_dp_plugin.cli import main
from vllm_dp_plugin.config import parse_section
from vllm_dp_plugin.plan import ContextPlan, ModelShape
from vllm_dp_plugin.reports import attention_report

from .engines import dp_section, write_dp_yaml

MODES = {
    "state-gaussian-pld": {},
    "state-gaussian-advanced": {"composition": "advanced"},
    "state-gaussian-rdp-3-per-head": {"composition": "rdp", "releases_per_head": 3},
    "state-truncated_laplace-pld": {"mechanism": "truncated_laplace"},
    "state-truncated_laplace-basic-2-per-head": {"mechanism": "truncated_laplace", "composition": "basic",
                                                  "releases_per_head": 2},
    "state-degree-rule": {"degree": None},
    "tree-pld": {"mode": "tree", "degree": 1},
    "tree-basic-2-per-head": {"mode": "tree", "degree": 1, "composition": "basic", "releases_per_head": 2},
}
ENDPOINT_ONLY = ("context", "ledger")  # keyed by the secret noise key / the deployment's ledger


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from vllm_dp_plugin.demo import make_demo_llama

    return make_demo_llama(tmp_path_factory.mktemp("demo") / "llama")


def section_for(tmp_path, **attention) -> dict:
    section = dp_section(tmp_path, 2.0, **attention)
    section["attention"] = {k: v for k, v in section["attention"].items() if v is not None}
    return section


def account(tmp_path, section, model, *flags) -> tuple[int, str]:
    """``vllm-dp account`` of ``section``: (exit status, stdout or, on failure, stderr). Not
    capsys: vLLM, imported during these tests, keeps the streams it finds."""
    path = write_dp_yaml(tmp_path / "dp.yaml", section)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["account", "--config", str(path), "--model", str(model), *flags])
    return code, out.getvalue() if code == 0 else err.getvalue()


@pytest.fixture(scope="module")
def engine_args():
    return pytest.importorskip("vllm.engine.arg_utils").EngineArgs


def vllm_config(engine_args, model, section):
    return engine_args(model=str(model), dtype="float32", max_model_len=1024, block_size=32, enforce_eager=True,
                       tokenizer_mode="dp_private", additional_config={"dp_privacy": section}).create_engine_config()


@pytest.mark.parametrize("attention", MODES.values(), ids=MODES.keys())
def test_account_prints_the_budget_endpoints_statement(engine_args, demo_model, tmp_path, attention):
    from vllm_dp_plugin.serving import settings

    section = section_for(tmp_path, **attention)
    code, out = account(tmp_path, section, demo_model, "--json")
    assert code == 0, out
    printed = json.loads(out)
    payload = settings.budget_payload(vllm_config(engine_args, demo_model, section))
    served = [{k: v for k, v in report.items() if k not in ENDPOINT_ONLY} for report in payload["contexts"]]
    assert printed == {**payload, "contexts": served}
    (report,) = printed["contexts"]
    att = parse_section(section).attention
    assert (report["mode"], report["composition"]) == (att.mode, att.composition)
    assert report["releases_per_head"] == att.releases_per_head
    assert report["planned"]["releases"] == report["releases"] * att.releases_per_head
    # what the configured budget covers is within it; one release spends its share of it
    assert report["planned"]["epsilon"] <= att.epsilon * (1 + 1e-6) and report["planned"]["delta"] <= att.delta
    assert report["spent"]["epsilon"] <= report["planned"]["epsilon"] * (1 + 1e-9)
    if att.releases_per_head > 1:
        assert report["spent"]["epsilon"] < report["planned"]["epsilon"]
    code, text = account(tmp_path, section, demo_model)
    assert code == 0 and attention_report(report) in text


def test_the_model_shape_is_read_alike_by_vllm_and_by_the_account_command(engine_args, demo_model, tmp_path):
    config = vllm_config(engine_args, demo_model, dp_section(tmp_path, 2.0))
    assert ModelShape.of(config) == ModelShape.from_pretrained(demo_model)


def test_each_release_gets_its_share_of_releases_per_head(demo_model, tmp_path):
    """Serving splits the budget over layers x KV heads x releases_per_head releases (the
    workers' releases are planned with that count) and states one release's spend."""
    shape = ModelShape.from_pretrained(demo_model)
    once, thrice = (parse_section(section_for(tmp_path, releases_per_head=r)).attention for r in (1, 3))
    one, three = (ContextPlan.of(att, shape, "self_attention", 40) for att in (once, thrice))
    assert three.budget_heads == 3 * one.budget_heads == 3 * shape.self_layers * shape.total_kv_heads
    assert three.layer_params(0).delta == one.layer_params(0).delta  # the total; the split is per release
    assert three.mechanisms[0].noise.sigma > one.mechanisms[0].noise.sigma
    assert three.spent(3).epsilon == pytest.approx(one.spent().epsilon, rel=1e-6)


def test_tree_mode_carves_delta_prime_out_of_the_budget(demo_model, tmp_path):
    """The DPTree's advanced-composition slack delta' used to be spent on top of the configured
    delta (1e-6 per (layer, KV head)): now the whole model spends at most the configured delta."""
    shape = ModelShape.from_pretrained(demo_model)
    att = parse_section(section_for(tmp_path, mode="tree", degree=1)).attention
    plan = ContextPlan.of(att, shape, "self_attention", 40)
    head_share = att.delta / (2 * plan.budget_heads)  # the advanced split of the total delta
    assert plan.params.tree.delta_prime == pytest.approx(head_share)
    assert plan.mechanisms[0].delta == pytest.approx(5 / 6 * head_share)
    assert plan.report()["spent"]["delta"] <= att.delta


def test_account_refuses_what_the_server_refuses(demo_model, tmp_path):
    section = section_for(tmp_path, num_layers=3)
    code, err = account(tmp_path, section, demo_model)
    assert code == 2 and "attention.num_layers is 3 but the served model has 2" in err
    section = section_for(tmp_path, private_context=None)
    code, err = account(tmp_path, section, demo_model)
    assert code == 2 and "attention.private_context (a text file) or attention.contexts" in err
    section = {**section_for(tmp_path), "attention": {**section_for(tmp_path)["attention"], "max_context": 8}}
    code, err = account(tmp_path, section, demo_model)
    assert code == 2 and "exceeds max_context=8" in err


def test_account_resolves_paths_relative_to_the_config_file(demo_model, tmp_path):
    section = section_for(tmp_path)
    (tmp_path / "conf").mkdir()
    relative = {**section, "attention": {**section["attention"], "private_context": "../context.txt"}}
    code, out = account(tmp_path / "conf", relative, demo_model, "--json")
    assert code == 0 and json.loads(out)["contexts"][0]["name"] == "default"


def test_releases_planned_under_new_rules_draw_other_noise(demo_model, tmp_path):
    """A tree-mode or releases_per_head > 1 release is planned differently than it used to be:
    its identity (which keys its noise) says so, so an old and a new release of the same context
    never share noise at different scales; state releases keep their identity."""
    from vllm_dp_plugin.serving.settings import ServedModel, release_inputs

    served = ServedModel(str(demo_model), None, str(demo_model), 1024, "float32", "auto", "cpu")
    assert "rules" not in release_inputs(parse_section(section_for(tmp_path)), served)["attention"]
    for extra in ({"mode": "tree", "degree": 1}, {"releases_per_head": 2}):
        assert release_inputs(parse_section(section_for(tmp_path, **extra)), served)["attention"]["rules"] == 2


@pytest.mark.parametrize("attention", [{}, {"mode": "tree", "degree": 1}], ids=["state", "tree"])
def test_whisper_account_states_each_requests_encoder_output_as_the_endpoint_does(engine_args, tmp_path, attention):
    from vllm_dp_plugin.demo_whisper import make_demo_whisper
    from vllm_dp_plugin.serving import settings

    model = make_demo_whisper(tmp_path / "whisper")
    section = {"key_file": str(tmp_path / "noise.key"), "attention": {
        "epsilon": 2.0, "delta": 1e-6, "bounds": dp_section(tmp_path, 2.0)["attention"]["bounds"], **attention}}
    code, out = account(tmp_path, section, model, "--json")
    assert code == 0, out
    config = engine_args(model=str(model), dtype="float32", max_model_len=448, enforce_eager=True,
                         limit_mm_per_prompt={"audio": 1},
                         additional_config={"dp_privacy": section}).create_engine_config()
    assert ModelShape.of(config) == ModelShape.from_pretrained(model)
    assert json.loads(out) == settings.budget_payload(config)
    (report,) = json.loads(out)["contexts"]
    assert report["kind"] == "cross_attention" and report["context_tokens"] == 1500
    other = {**section, "attention": {**section["attention"], "epsilon": 4.0}}
    config_4 = engine_args(model=str(model), dtype="float32", max_model_len=448, enforce_eager=True,
                           limit_mm_per_prompt={"audio": 1},
                           additional_config={"dp_privacy": other}).create_engine_config()
    assert settings.encoder_release_inputs(config) != settings.encoder_release_inputs(config_4)  # keys the noise
