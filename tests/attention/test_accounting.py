"""Per-document statements: a release stated for a group of rows (one document's)."""

import math

import pytest
from dp_accounting.gaussian_mechanism import get_epsilon_gaussian

from vllm_dp_plugin.attention.accounting import group_mechanism
from vllm_dp_plugin.config import DPPrivacyConfig
from vllm_dp_plugin.plan import ContextPlan
from vllm_dp_plugin.privacy.mechanisms import gaussian_mechanism, truncated_laplace_mechanism

BOUNDS = {"key_bound": 0.5, "query_bound": 0.5, "value_bound": 1.0, "key_norm": 1.5, "query_norm": 1.5}


def test_a_gaussian_release_over_a_group_is_the_gaussian_with_the_group_sensitivity():
    one = gaussian_mechanism(2.0, 1.0, 1e-6)
    group = group_mechanism(one, 4)
    assert group.sensitivity == 8.0 and math.sqrt(group.variance) == pytest.approx(math.sqrt(one.variance))
    z = math.sqrt(one.variance) / 2.0
    assert group.dp_event.noise_multiplier == pytest.approx(z / 4)
    assert group.epsilon == pytest.approx(get_epsilon_gaussian(z / 4, 1e-6))
    assert group_mechanism(one, 1) is one


def test_other_releases_over_a_group_take_group_privacy_and_say_when_it_gives_nothing():
    one = truncated_laplace_mechanism(1.0, 0.5, 1e-8)
    group = group_mechanism(one, 3)
    assert group.epsilon == pytest.approx(1.5)
    assert group.delta == pytest.approx(3 * math.exp(2 * 0.5) * 1e-8)
    hopeless = group_mechanism(truncated_laplace_mechanism(1.0, 2.0, 1e-3), 64)
    assert math.isinf(hopeless.epsilon) and hopeless.delta == 1.0


def test_the_per_document_statement_composes_each_open_release_over_the_documents_rows():
    cfg = DPPrivacyConfig.from_dict({"attention": {
        "epsilon": 4.0, "delta": 1e-6, "bounds": BOUNDS, "gate": False, "composition": "basic",
        "unit": "document", "document_tokens": 5}}).attention
    plan = ContextPlan(cfg, "self_attention", 3, 2, 4, 8, 8**-0.5, 50)
    per = plan.per_document()
    release = plan.mechanisms[0]  # basic: every release the same Gaussian
    z = release.dp_event.noise_multiplier
    direct = 3 * 2 * get_epsilon_gaussian(z / 5, release.delta)
    assert per["spent"]["epsilon"] == pytest.approx(direct, rel=1e-9)
    assert per["documents"] == 10 and "at most 5 tokens" in per["unit"]
    assert plan.report()["spent"]["epsilon"] == pytest.approx(4.0)  # the row-level statement, beside it
    row = ContextPlan(cfg.__class__(**{**cfg.__dict__, "unit": "row"}), "self_attention", 3, 2, 4, 8, 8**-0.5, 50)
    assert isinstance(row.per_document(), str) and "unit row" in row.per_document()
