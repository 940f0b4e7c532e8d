"""Training accountant: noise calibration against sigmas computed with fastDP's own RDP
accountant (``rdp_accounting.py``; ML-1M N = 6040, Amazon Games N = 31013) and Opacus' RDP
calibration; the recorded steps spend the calibrated budget; the integer-order accountant of
secure mode bounds the sampled discrete Gaussian (proof below)."""

import itertools
import math

import numpy as np
import pytest
from dp_accounting.rdp.rdp_privacy_accountant import _compute_rdp_poisson_subsampled_gaussian
from opacus.accountants.utils import get_noise_multiplier
from scipy import stats
from scipy.special import logsumexp

from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.trainer.accounting import (
    CALIBRATION_RTOL,
    TrainingAccountant,
    noise_multiplier_for,
)

# (N, B, steps, epsilon, sigma) from fastDP's RDP accountant, delta = 1/(2N), q = B/N,
# steps = ceil(100 epochs / q).
SPEC_ROWS = [
    (6040, 256, 2360, 5, 1.941),
    (31013, 1024, 3029, 10, 1.179),
    (31013, 4096, 758, 5, 3.517),
]


@pytest.mark.parametrize(("n", "batch", "steps", "epsilon", "sigma"), SPEC_ROWS)
def test_rdp_calibration_matches_spec_table(n, batch, steps, epsilon, sigma):
    """Within 1%: fastDP's accountant uses fewer RDP orders (1.1..10.9, 12..63) and a different
    RDP-to-(eps, delta) conversion than dp-accounting; we measured deviations <= 0.7% over these
    rows; different accountants (PRV, Opacus' RDP conversion) differ by a few percent."""
    got = noise_multiplier_for(epsilon, 1 / (2 * n), batch / n, steps)
    assert got == pytest.approx(sigma, rel=0.01)


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")
@pytest.mark.parametrize(("epsilon", "delta", "rate", "steps"), [(1.0, 1e-6, 0.05, 200)])
def test_rdp_calibration_matches_opacus(epsilon, delta, rate, steps):
    """Opacus bisects in epsilon to 0.001 absolute (its default tolerance, set here to 1e-3
    relative); both use RDP orders and the same CKS-style conversion, so 1% covers both ends."""
    theirs = get_noise_multiplier(
        target_epsilon=epsilon, target_delta=delta, sample_rate=rate, steps=steps,
        accountant="rdp", epsilon_tolerance=1e-3 * epsilon,
    )
    assert noise_multiplier_for(epsilon, delta, rate, steps) == pytest.approx(theirs, rel=0.01)


EPSILON, DELTA, RATE, STEPS = 3.0, 1e-5, 0.02, 100


@pytest.fixture(scope="module")
def sigmas():
    return {kind: noise_multiplier_for(EPSILON, DELTA, RATE, STEPS, kind) for kind in ("rdp", "pld", "rdp_integer")}


@pytest.mark.parametrize("kind", ["rdp", "pld", "rdp_integer"])
def test_accountant_spends_the_calibrated_budget(kind, sigmas):
    """The calibrated sigma meets the target (epsilon <= target) and is the smallest that does:
    sigma shrunk by 1% (10 x CALIBRATION_RTOL) overspends."""
    epsilon, delta, rate, steps, sigma = EPSILON, DELTA, RATE, STEPS, sigmas[kind]
    spent = TrainingAccountant(sigma, rate, delta, accountant=kind)
    assert spent.epsilon() == 0.0
    spent.step(steps - 1)
    spent.step()
    assert spent.epsilon() <= epsilon
    assert spent.epsilon() == pytest.approx(epsilon, rel=1e-3)
    assert spent.budget() == Budget(spent.epsilon(), delta)
    assert spent.spent(delta * 10) < spent.epsilon()
    tighter = TrainingAccountant(sigma * (1 - 10 * CALIBRATION_RTOL), rate, delta, accountant=kind)
    tighter.step(steps)
    assert tighter.epsilon() > epsilon


def test_pld_needs_less_noise_than_rdp(sigmas):
    assert sigmas["pld"] < sigmas["rdp"]


def test_integer_orders_cost_little_noise(sigmas):
    """Dropping the fractional orders can only raise epsilon; here by < 5% in sigma."""
    assert sigmas["rdp"] <= sigmas["rdp_integer"] < 1.05 * sigmas["rdp"]


# ---------- the sampled discrete Gaussian (secure mode) against rdp_integer ----------


def _log_pmf(sigma: float, shift: tuple[int, ...], radius: int) -> tuple[np.ndarray, np.ndarray]:
    """log N_Z(0, sigma^2 I) and log N_Z(shift, sigma^2 I) on the box [-radius, radius]^d (its
    outside mass, < exp(-radius^2 / (2 sigma^2)) ~ 1e-30 here, is dropped): both ``[points]``."""
    axis = np.arange(-radius, radius + 1)
    x = np.array(list(itertools.product(axis, repeat=len(shift))), dtype=np.float64)
    log_theta = logsumexp(-(x**2).sum(1) / (2 * sigma**2))
    return -(x**2).sum(1) / (2 * sigma**2) - log_theta, -((x - shift) ** 2).sum(1) / (2 * sigma**2) - log_theta


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("shift", [(1,), (2,), (3,), (1, 1), (2, 1)])
def test_rdp_integer_bounds_the_sampled_discrete_gaussian(sigma, shift):
    """Exact Renyi divergences of M = (1-q) P0 + q P1 and P0 (P0, P1 discrete Gaussians whose
    means differ by the integer vector ``shift``; small sigma, where the lattice matters most) at
    integer orders, both directions, are at most dp-accounting's sampled-Gaussian RDP of noise
    multiplier sigma / |shift|, the curve ``rdp_integer`` composes.

    Proof. Let L = P1/P0 and m = 1 - q + q L, so exp((a-1) D_a(M || P0)) = E_P0[m^a] and
    exp((a-1) D_a(P0 || M)) = E_P0[m^(1-a)]. (i) For an integer a, E_P0[m^a] expands into
    binomial terms with positive weights and the moments E_P0[L^k] = exp(k(k-1)|mu|^2/(2 s^2))
    Theta(k mu)/Theta(0) <= exp(k(k-1)|mu|^2/(2 s^2)), the Gaussian's (the lattice theta function
    peaks at 0: its Fourier coefficients are positive). (ii) The reflection x -> mu - x maps P0 to
    P1 and L to 1/L, so E_P0[f(L)] = E_P0[L f(1/L)]; symmetrising both expectations it suffices
    that h(l) = g(1-q+ql) + l g(1-q+q/l) >= 0 for l > 0, g(x) = x^a - x^(1-a). As h(1/l) =
    h(l)/l, take l >= 1, t = q(l-1), s = q(1-1/l): l = t/s and t >= s/(1-s). g is convex on
    [1, inf) with g(1) = 0, so g(1+t)/t grows with t: g(1+t)/t >= g(1/(1-s)) (1-s)/s = -g(1-s)/s,
    i.e. g(1+t) >= -l g(1-s). So D_a(P0 || M) <= D_a(M || P0), as for the Gaussian."""
    orders = list(range(2, 13))
    log_p0, log_p1 = _log_pmf(sigma, shift, radius=int(12 * sigma) + 4 * max(shift))
    norm = math.sqrt(sum(m * m for m in shift))
    for q in (0.01, 0.2, 0.5):
        log_m = np.logaddexp(math.log1p(-q) + log_p0, math.log(q) + log_p1)
        bound = _compute_rdp_poisson_subsampled_gaussian(q, sigma / norm, orders)
        for a, rdp in zip(orders, bound, strict=True):
            add = logsumexp(a * log_m + (1 - a) * log_p0) / (a - 1)
            remove = logsumexp(a * log_p0 + (1 - a) * log_m) / (a - 1)
            assert max(add, remove) <= rdp * (1 + 1e-9), (q, a, add, remove, rdp)


def test_the_remove_direction_lemma():
    """Step (ii) of the proof above, on a grid: h(l) >= 0 (0 at l = 1), in log space."""
    log_l = np.linspace(-30, 30, 20001)
    for q, a in itertools.product((1e-4, 0.01, 0.3, 0.9, 0.999), (2, 3, 8, 64)):
        up, down = np.log1p(q * np.expm1(log_l)), np.log1p(q * np.expm1(-log_l))
        lhs = np.logaddexp(a * up, log_l + a * down)
        rhs = np.logaddexp((1 - a) * up, log_l + (1 - a) * down)
        assert (lhs - rhs).min() >= -1e-12


def test_the_discrete_gaussian_is_not_the_gaussian_in_epsilon_delta():
    """Why secure mode refuses ``pld`` (and any (epsilon, delta) calibration of the Gaussian): with
    sigma = 1 and shift 1, the discrete Gaussian's privacy profile delta(epsilon) exceeds the
    continuous Gaussian's by > 0.01 at some epsilon (its privacy loss has atoms)."""
    log_p0, log_p1 = _log_pmf(1.0, (1,), radius=40)
    p0, loss = np.exp(log_p0), log_p0 - log_p1
    for epsilon in np.linspace(0.0, 1.0, 101):
        discrete = np.maximum(0.0, p0 * (1 - np.exp(epsilon - loss))).sum()
        gaussian = stats.norm.cdf(0.5 - epsilon) - math.exp(epsilon) * stats.norm.cdf(-0.5 - epsilon)
        if discrete > gaussian + 0.01:
            return
    raise AssertionError("the discrete Gaussian's profile stayed below the Gaussian's")


@pytest.mark.parametrize(
    "call",
    [
        lambda: noise_multiplier_for(0.0, 1e-5, 0.01, 10),
        lambda: noise_multiplier_for(1.0, 1.0, 0.01, 10),
        lambda: noise_multiplier_for(1.0, 1e-5, 1.5, 10),
        lambda: noise_multiplier_for(1.0, 1e-5, 0.01, 0),
        lambda: noise_multiplier_for(1.0, 1e-5, 0.01, 10, accountant="prv"),
        lambda: TrainingAccountant(0.0, 0.01, 1e-5),
        lambda: TrainingAccountant(1.0, 0.01, 0.0),
        lambda: TrainingAccountant(1.0, 0.01, 1e-5).step(0),
    ],
)
def test_bad_input_raises(call):
    with pytest.raises(ValueError):
        call()
