"""From the typed config and a model shape to the releases and the privacy statement."""

import math

import pytest
import torch

from vllm_dp_plugin.attention.mapping import HeadMapping
from vllm_dp_plugin.attention.plan import ContextPlan
from vllm_dp_plugin.calibration import Calibration
from vllm_dp_plugin.config import ConfigError, DPPrivacyConfig

BOUNDS = {"key_bound": 0.5, "query_bound": 0.5, "value_bound": 1.0, "key_norm": 1.5, "query_norm": 1.5}


def _plan(layers=3, kv_heads=2, head_dim=8, **attention):
    cfg = DPPrivacyConfig.from_dict({"attention": {"epsilon": 4.0, "delta": 1e-6, **attention}}).attention
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
