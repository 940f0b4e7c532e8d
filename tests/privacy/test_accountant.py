"""Accountant values cross-checked against dp-accounting used directly."""

import math

import pytest
from dp_accounting import GaussianDpEvent, LaplaceDpEvent, SelfComposedDpEvent
from dp_accounting.pld import accountant as pld_theorems
from dp_accounting.pld import common as pld_common
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

from vllm_dp_plugin.privacy import (
    Budget,
    PrivacyLedger,
    calibrate_noise_multiplier,
    gaussian_mechanism,
    laplace_mechanism,
    split_budget,
    truncated_laplace_mechanism,
)
from vllm_dp_plugin.privacy.accountant import advanced_epsilon
from vllm_dp_plugin.privacy.budget import MECHANISM_KINDS, plan_releases


def ledger_of(mechanism, count, composition, target_delta=1e-6):
    ledger = PrivacyLedger(composition, target_delta)
    ledger.record(mechanism, count)
    return ledger


def test_basic_composition_adds_up():
    ledger = PrivacyLedger("basic")
    ledger.record(truncated_laplace_mechanism(1.0, 0.5, 1e-7), 4)
    ledger.record(laplace_mechanism(1.0, 0.25), 2)
    assert ledger.spent() == Budget(pytest.approx(2.5), pytest.approx(4e-7))


def test_pld_gaussian_equals_dp_accounting():
    mech = gaussian_mechanism(1.0, 1.0, 1e-6)
    expected = PLDAccountant().compose(
        SelfComposedDpEvent(GaussianDpEvent(mech.noise.sigma), 16)
    ).get_epsilon(1e-5)
    assert ledger_of(mech, 16, "pld", 1e-5).spent().epsilon == pytest.approx(expected, rel=1e-9)


def test_rdp_laplace_equals_dp_accounting():
    mech = laplace_mechanism(2.0, 0.5)
    expected = RdpAccountant().compose(
        SelfComposedDpEvent(LaplaceDpEvent(mech.noise.scale / 2.0), 10)
    ).get_epsilon(1e-6)
    assert ledger_of(mech, 10, "rdp").spent().epsilon == pytest.approx(expected, rel=1e-9)


def test_advanced_composition_equals_dp_accounting_and_beats_basic():
    mech = truncated_laplace_mechanism(1.0, 0.1, 1e-8)
    k, total_delta = 200, 1e-5
    expected = pld_theorems.advanced_composition(
        pld_common.DifferentialPrivacyParameters(0.1, 1e-8), k, total_delta
    )
    spent = ledger_of(mech, k, "advanced", total_delta).spent()
    assert spent.epsilon == pytest.approx(expected, rel=1e-12)
    assert spent.epsilon < 0.1 * k


def test_pld_of_generic_eps_delta_matches_optimal_advanced_composition():
    """The PLD of a generic (eps, delta) mechanism composes like Kairouz et al.'s optimal
    theorem, which dp-accounting evaluates on the lattice eps (k - 2i): PLD lies within one
    lattice step below it."""
    mech = truncated_laplace_mechanism(1.0, 0.2, 1e-9)
    k, total_delta = 50, 1e-6
    optimal = pld_theorems.advanced_composition(
        pld_common.DifferentialPrivacyParameters(0.2, 1e-9), k, total_delta
    )
    pld = ledger_of(mech, k, "pld", total_delta).spent().epsilon
    assert optimal - 2 * 0.2 < pld <= optimal


def test_gaussian_pld_calibration_is_exact():
    """k Gaussian releases at multiplier m compose to one at m / sqrt(k)."""
    total, k = Budget(2.0, 1e-6), 64
    m = calibrate_noise_multiplier(total, k, "gaussian", "pld")
    eps = PLDAccountant().compose(SelfComposedDpEvent(GaussianDpEvent(m), k)).get_epsilon(1e-6)
    assert eps == pytest.approx(2.0, rel=2e-3)


@pytest.mark.parametrize("kind", MECHANISM_KINDS)
@pytest.mark.parametrize("composition", ["basic", "advanced", "pld", "rdp"])
def test_planned_releases_never_overspend(kind, composition):
    total, k = Budget(4.0, 1e-6), 24
    if composition == "rdp" and kind == "truncated_laplace":
        with pytest.raises(ValueError, match="rdp"):
            plan_releases(total, k, kind, composition)
        return
    ledger = plan_releases(total, k, kind, composition, sensitivity=3.0)
    spent = ledger.spent()
    assert spent.epsilon <= total.epsilon * (1 + 1e-3)
    assert spent.delta <= total.delta * (1 + 1e-9)
    assert ledger.releases[0].count == k and ledger.releases[0].mechanism.sensitivity == 3.0


def test_split_budget():
    assert split_budget(Budget(8.0, 1e-6), 4, "basic") == Budget(2.0, 2.5e-7)
    adv = split_budget(Budget(1.0, 1e-6), 1000, "advanced")
    assert adv.epsilon > 1.0 / 1000 and adv.delta == pytest.approx(5e-10)
    assert advanced_epsilon(adv.epsilon, adv.delta, 1000, 1e-6) <= 1.0


def test_advanced_epsilon_survives_large_k():
    """dp-accounting's optimal theorem overflows at large k; the DRV bound still answers."""
    eps = advanced_epsilon(0.01, 1e-10, 5000, 1e-5)
    expected = 0.01 * math.sqrt(2 * 5000 * math.log(1 / (1e-5 - 5000e-10))) + 5000 * 0.01 * math.expm1(0.01)
    assert eps == pytest.approx(expected, rel=1e-12)


def test_advanced_epsilon_of_huge_eps_does_not_overflow():
    """eps = 1e7 (the benchmarks' kernel-error-only row): e^eps overflows a float, so the DRV
    bound is inf and the optimal theorem (here k eps, basic composition) answers."""
    assert advanced_epsilon(1e7, 1e-10, 65, 1e-5) == pytest.approx(65 * 1e7)
    assert advanced_epsilon(700.0, 1e-10, 3, 1e-5) == pytest.approx(3 * 700.0)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: split_budget(Budget(0.0, 1e-6), 4), "epsilon"),
        (lambda: split_budget(Budget(1.0, 1.0), 4), "delta"),
        (lambda: split_budget(Budget(math.nan, 1e-6), 4), "epsilon"),
        (lambda: split_budget(Budget(1.0, 1e-6), 0), "releases"),
        (lambda: PrivacyLedger("magic"), "composition"),
        (lambda: PrivacyLedger("pld", target_delta=0.0), "target_delta"),
        (lambda: plan_releases(Budget(1.0, 1e-6), 4, "cauchy", "pld"), "mechanism"),
    ],
)
def test_bad_accounting_inputs(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("kind", MECHANISM_KINDS)
@pytest.mark.parametrize("composition", ["basic", "advanced", "pld"])
def test_planned_noise_matches_its_accounting(kind, composition):
    """Re-account the noise a planned release actually samples, from the noise law alone
    (not from its DpEvent): the k-fold composition must stay within the total budget."""
    total, k, sens = Budget(4.0, 1e-6), 24, 3.0
    mech = plan_releases(total, k, kind, composition, sensitivity=sens).releases[0].mechanism
    noise = mech.noise
    if kind == "truncated_laplace":
        # the bound must reproduce the stated per-release delta (shift by Delta), and the
        # stated per-release (eps, delta) must compose within the total
        assert noise.scale == pytest.approx(sens / mech.epsilon, rel=1e-12)
        assert float(noise.cdf(-noise.bound + sens)) == pytest.approx(mech.delta, rel=1e-6)
        assert k * mech.delta <= total.delta * (1 + 1e-12)
        if composition == "basic":
            assert k * mech.epsilon <= total.epsilon * (1 + 1e-12)
        else:
            assert advanced_epsilon(mech.epsilon, mech.delta, k, total.delta) <= total.epsilon
        return
    if kind == "gaussian":
        event = GaussianDpEvent(math.sqrt(noise.variance) / sens)
    else:
        assert math.isinf(noise.bound)
        event = LaplaceDpEvent(noise.scale / sens)
    eps = PLDAccountant().compose(SelfComposedDpEvent(event, k)).get_epsilon(total.delta)
    assert eps <= total.epsilon * 1.001
    if composition == "pld":  # calibrated on the composed curve: no budget left on the table
        assert eps >= total.epsilon * 0.99
