"""Calibration test vectors from the specs, and clear errors for bad inputs."""

import math

import pytest

from vllm_dp_plugin.privacy import (
    gaussian_mechanism,
    laplace_mechanism,
    truncated_laplace_mechanism,
)
from vllm_dp_plugin.privacy.mechanisms import gaussian_sigma


@pytest.mark.parametrize(
    "eps,sigma", [(1.0, 8.449), (5.0, 1.960), (10.0, 1.082), (20.0, 0.618)]
)
def test_analytic_gaussian_spec_values(eps, sigma):
    """Analytic Gaussian (Balle & Wang 2018) reference values: sigma(eps, 1e-6) with
    Delta_2 = 2C, C = 1."""
    assert gaussian_sigma(2.0, eps, 1e-6, "analytic") == pytest.approx(sigma, abs=1e-3)


def test_classic_gaussian_formula_and_domain():
    sigma = gaussian_sigma(2.0, 0.5, 1e-5, "classic")
    assert sigma == pytest.approx(2.0 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 0.5, rel=1e-12)
    with pytest.raises(ValueError, match="eps <= 1"):
        gaussian_sigma(2.0, 2.0, 1e-5, "classic")


def test_analytic_is_tighter_than_classic():
    assert gaussian_sigma(1.0, 0.5, 1e-5, "analytic") < gaussian_sigma(1.0, 0.5, 1e-5, "classic")


def test_laplace_scale_and_statement():
    mech = laplace_mechanism(3.0, 1.5)
    assert mech.noise.scale == 2.0 and mech.delta == 0.0 and mech.variance == 8.0
    assert "(1.5, 0)-DP" in mech.statement()


BAD_EPS = [0.0, -1.0, float("nan"), float("inf"), "x", None, True]
BAD_DELTA = [0.0, 1.0, -1e-6, 1.5, float("nan")]


@pytest.mark.parametrize("eps", BAD_EPS)
def test_bad_epsilon_is_rejected(eps):
    for make in (
        lambda: laplace_mechanism(1.0, eps),
        lambda: gaussian_mechanism(1.0, eps, 1e-5),
        lambda: truncated_laplace_mechanism(1.0, eps, 1e-5),
    ):
        with pytest.raises(ValueError, match="epsilon"):
            make()


@pytest.mark.parametrize("delta", BAD_DELTA)
def test_bad_delta_is_rejected(delta):
    for make in (
        lambda: gaussian_mechanism(1.0, 1.0, delta),
        lambda: truncated_laplace_mechanism(1.0, 1.0, delta),
    ):
        with pytest.raises(ValueError, match="delta"):
            make()


def test_bad_sensitivity_and_calibration():
    with pytest.raises(ValueError, match="sensitivity"):
        laplace_mechanism(float("nan"), 1.0)
    with pytest.raises(ValueError, match="calibration"):
        gaussian_sigma(1.0, 1.0, 1e-5, "magic")
    with pytest.raises(ValueError, match="delta < 0.5"):
        truncated_laplace_mechanism(1.0, 1.0, 0.6)
