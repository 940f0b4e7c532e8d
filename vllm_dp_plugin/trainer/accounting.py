"""Privacy accounting of DP-SGD / DP-Adam training on dp-accounting.

One training step is a Poisson-subsampled Gaussian mechanism: each of the N training samples is
in the step's batch independently with probability ``sample_rate = q``, and the clipped sum
(sensitivity C) gets Gaussian noise of std ``noise_multiplier * C``. ``steps`` such steps compose.
Two accountants: ``rdp`` (dp-accounting's Renyi accountant; the analysis the paper cites and the
one fastDP uses) and ``pld`` (privacy-loss distributions, tighter). Neighbouring datasets differ
by adding or removing one sample, dp-accounting's relation for Poisson subsampling (the one its
amplification analysis holds for).

``rdp_integer`` is the Renyi accountant at integer orders only: the accountant of secure mode,
whose steps add discrete Gaussian noise to an integer vector (``privacy.noise.GridGaussian``,
noise multiplier = integer sigma / integer sensitivity). At an integer order alpha, the sampled
Gaussian's A_alpha = sum_k C(alpha, k) (1-q)^(alpha-k) q^k exp(k(k-1) / (2 s^2)) bounds the
sampled discrete Gaussian in both directions: (i) D_alpha(mixture || P0) expands binomially into
the moments E_P0[(P1/P0)^k] = exp(k(k-1) |mu|^2 / (2 sigma^2)) Theta(k mu) / Theta(0), where the
lattice theta function Theta peaks at 0 (Canonne, Kamath & Steinke 2020); (ii) the reflection
x -> mu - x swaps P0 and P1, so D_alpha(P0 || mixture) <= D_alpha(mixture || P0) as for the
Gaussian (``tests/trainer/test_accounting.py`` has the proof and checks both exactly). Mixing
over the rest of the batch and composing steps then go as for any Renyi bound. Fractional
orders use a series specific to the continuous Gaussian and ``pld`` its loss distribution, which
the discrete Gaussian does not meet at every epsilon.
"""

from __future__ import annotations

from typing import Literal

from dp_accounting import dp_event, mechanism_calibration
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.validation import (
    check_count,
    check_delta,
    check_epsilon,
    check_positive,
)

TrainingAccountantKind = Literal["rdp", "pld", "rdp_integer"]
ACCOUNTANTS: tuple[str, ...] = ("rdp", "pld", "rdp_integer")
INTEGER_RDP_ORDERS = (*range(2, 64), 128, 256, 512, 1024)

# Bisection stops when the bracket is this narrow relative to its lower end; the returned sigma
# is the bracket's upper end, so it always meets the target and is at most 1e-3 relative too big
# (fastDP bisects to 1e-3 absolute and rounds up likewise).
CALIBRATION_RTOL = 1e-3
MAX_DOUBLINGS = 40  # the bracket search takes at most this many steps each way
# PLD loss-grid step. The discretisation is pessimistic (a valid upper bound on epsilon); 1e-3
# instead of dp-accounting's 1e-4 is 10x faster and moved epsilon by < 1e-4 relative in our
# check (q = 0.01, 1000 steps, sigma 0.68, delta 1e-5: 5.00021 vs 4.99992).
PLD_DISCRETIZATION = 1e-3


def training_event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_event.DpEvent:
    """``steps`` Poisson-subsampled Gaussian steps (noise std ``noise_multiplier`` x sensitivity)."""
    step = dp_event.PoissonSampledDpEvent(sample_rate, dp_event.GaussianDpEvent(noise_multiplier))
    return dp_event.SelfComposedDpEvent(step, steps)


def noise_multiplier_for(
    epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: TrainingAccountantKind = "rdp",
) -> float:
    """Smallest noise multiplier sigma (to ``CALIBRATION_RTOL``, rounded up) such that ``steps``
    Poisson-subsampled Gaussian steps at rate ``sample_rate`` are (``epsilon``, ``delta``)-DP
    under ``accountant``. The result is conservative: its epsilon is <= ``epsilon``.

    PLD is never looser than RDP, so its search starts at the RDP sigma (which meets the target)
    and moves down in small steps: PLD at a tiny sigma needs an enormous discretised loss range."""
    _check_training(sample_rate, steps, accountant)
    check_epsilon(epsilon)
    check_delta(delta)
    target = Budget(epsilon, delta)
    if accountant != "pld":
        return _smallest_sigma(accountant, target, sample_rate, steps, start=1.0, shrink=0.5)
    rdp_sigma = _smallest_sigma("rdp", target, sample_rate, steps, start=1.0, shrink=0.5)
    return _smallest_sigma("pld", target, sample_rate, steps, start=rdp_sigma, shrink=0.8)


def _smallest_sigma(
    kind, target: Budget, sample_rate: float, steps: int, start: float, shrink: float
) -> float:
    """Bracket sigma by doubling from ``start`` until it meets ``target``, then multiplying by
    ``shrink`` until it fails (at most ``MAX_DOUBLINGS`` steps each), then dp-accounting's
    bisection to ``CALIBRATION_RTOL`` relative; the answer meets ``target``."""

    def fits(sigma: float) -> bool:
        return _epsilon(kind, sigma, sample_rate, steps, target.delta) <= target.epsilon

    upper = _walk(start, 2.0, stop=fits)
    lower = _walk(upper * shrink, shrink, stop=lambda sigma: not fits(sigma))
    return float(
        mechanism_calibration.calibrate_dp_mechanism(
            lambda: _fresh_accountant(kind),
            lambda sigma: training_event(sigma, sample_rate, steps),
            target.epsilon,
            target.delta,
            mechanism_calibration.ExplicitBracketInterval(lower, upper),
            tol=CALIBRATION_RTOL * lower,
        )
    )


def _walk(sigma: float, factor: float, stop) -> float:
    """First of ``sigma, sigma * factor, ...`` where ``stop`` holds."""
    for _ in range(MAX_DOUBLINGS):
        if stop(sigma):
            return sigma
        sigma *= factor
    raise ValueError(f"no noise multiplier up to {sigma:.3g} brackets the privacy target")


def _epsilon(kind, noise_multiplier, sample_rate, steps, delta) -> float:
    accountant = _fresh_accountant(kind)
    accountant.compose(training_event(noise_multiplier, sample_rate, steps))
    return float(accountant.get_epsilon(delta))


class TrainingAccountant:
    """Records DP training steps at a fixed (``noise_multiplier``, ``sample_rate``) and reports
    the (epsilon, delta) spent so far; ``delta`` is the reporting delta of ``epsilon()``."""

    def __init__(
        self,
        noise_multiplier: float,
        sample_rate: float,
        delta: float,
        accountant: TrainingAccountantKind = "rdp",
    ):
        _check_training(sample_rate, 1, accountant)
        self.noise_multiplier = check_positive(noise_multiplier, "noise_multiplier")
        self.sample_rate = sample_rate
        self.delta = check_delta(delta)
        self.accountant = accountant
        self.steps = 0

    def step(self, n: int = 1) -> None:
        """Record ``n`` more training steps."""
        self.steps += check_count(n, "n")

    def spent(self, delta: float) -> float:
        """Epsilon of the steps recorded so far at ``delta`` (0 before the first step)."""
        check_delta(delta)
        if self.steps == 0:
            return 0.0
        return _epsilon(self.accountant, self.noise_multiplier, self.sample_rate, self.steps, delta)

    def epsilon(self) -> float:
        """Epsilon spent so far at the accountant's ``delta``."""
        return self.spent(self.delta)

    def budget(self) -> Budget:
        """(epsilon spent so far, ``delta``)."""
        return Budget(self.epsilon(), self.delta)


def _fresh_accountant(kind: TrainingAccountantKind):
    if kind == "pld":
        return pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    if kind == "rdp_integer":
        return rdp_privacy_accountant.RdpAccountant(orders=INTEGER_RDP_ORDERS)
    return rdp_privacy_accountant.RdpAccountant()


def _check_training(sample_rate: float, steps: int, accountant: str) -> None:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; use one of {ACCOUNTANTS}")
    rate = check_positive(sample_rate, "sample_rate")
    if rate > 1:
        raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate!r}")
    check_count(steps, "steps")
