"""Calibrated additive-noise mechanisms with exact (epsilon, delta) statements.

A ``Mechanism`` couples a noise law with the guarantee its calibration proves, and with the
``DpEvent`` the accountant composes. Sensitivities are inputs: they must come from public bounds
(clipping ranges), never from the private data.

Calibrations (float64, exact formulas):
* ``laplace_mechanism``: scale = l1 sensitivity / epsilon, pure epsilon-DP.
* ``truncated_laplace_mechanism``: TLap(Delta, eps, delta) of the DP cross-attention paper,
  Def. 3.4: scale Delta/eps, bound B = (Delta/eps) log(1 + (e^eps - 1)/(2 delta)); Fact 3.5 variance.
* ``gaussian_mechanism``: ``analytic`` (Balle & Wang 2018, via dp-accounting) or ``classic``
  (sigma = Delta sqrt(2 ln(1.25/delta)) / eps, valid only for eps <= 1).
The high-dimensional truncated Laplace (TrLaplace) lives in ``trlaplace.py``.

Floating point. Every guarantee stated here is a theorem about real numbers: ``f(x) + Z`` with Z
of the exact law. The code computes ``fl(f(x) + z)`` with z a float64 sample, and the set of
floats that sum can take depends on f(x) (Mironov 2012): ``fl(1 + z)`` is always a multiple of
2^-53, while ``0 + z`` is not whenever |z| < 1/2 and z's last bits are set, so "not a multiple of
2^-53" separates the inputs 0 and 1 (an empirical audit found an output set of probability 18.6%
under one and 0 under the other). A raw float release is not (epsilon, delta)-DP at any epsilon.
Where this project computes such a release, and what can observe it:

* DP-SGD (``trainer``): the noisy clipped sum of each step determines the gradients, the
  optimizer state and the exported weights, which are published: observable (Jin et al. 2022
  attack Opacus' float32 noisy gradients this way). ``secure_mode`` releases it as
  ``noise.GridGaussian`` instead: the floats are a function of an integer vector (grid + exact
  discrete Gaussian) whose law is the DP one. Re-Attention's token-frequency histogram
  (``trainer.reattention``) is a float release that training uses the same way; secure mode
  refuses Re-Attention.
* The attention release (noisy state or tree, ``attention``): internal, never sent. Clients see
  tokens sampled from logits computed from it (and, if they ask for ``logprobs``, those tokens'
  log-probabilities: floats computed from it through the rest of the model). Post-processing
  preserves DP only of a DP input, so these outputs inherit no theorem from a float release.
  What holds: the float release is within float64 rounding (relative ~2^-52 per operation) of
  the ideal DP release, and a token depends on it only through its sampling probabilities (or,
  greedy, through comparisons of logits), so the tokens' law differs from the ideal
  mechanism's by a total variation of the order of that rounding times how fast the
  probabilities move: an additive delta we do not bound. The release's own low-order bits are
  never sent; returned logprobs are floats of a long float computation from it, where no
  distinguisher is known but none is excluded either.
* Prompt privatization (``prompt``): the outputs are candidate tokens, but which candidate is
  chosen (nearest to ``x_w + noise``, or the exponential mechanism's Gumbel-max) is decided by
  comparisons of float64 quantities. The token reveals only which cell the float point fell in;
  rounding moves the cell boundaries by ~2^-52 relative, so its law differs from the ideal one
  by an unbounded-but-tiny total variation (Ilvento 2020 shows float exponential mechanisms
  failing pure DP at the margins). Releasing the noisy vectors themselves would be a float
  release (the privatizer returns ids only).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from dp_accounting import dp_event
from dp_accounting.gaussian_mechanism import get_epsilon_gaussian, get_sigma_gaussian

from .events import EpsilonDeltaDpEvent
from .noise import GaussianNoise, LaplaceNoise, NoiseDistribution, Shape
from .validation import check_delta, check_epsilon, check_positive


class NotDifferentiallyPrivateWarning(UserWarning):
    """A paper-literal or reproduction mode whose stated (epsilon, delta) is not a DP guarantee."""


@dataclass(frozen=True)
class Mechanism:
    """A calibrated mechanism: the ideal real-valued release ``f(x) + Z``, Z of law ``noise``, is
    (epsilon, delta)-DP when ``valid``. The float64 sum ``f(x) + sample(...)`` is NOT: its
    low-order bits depend on f(x) (module docstring, "Floating point"). Give it only to
    computations whose outputs do not expose it (the internal releases listed there), or
    release through ``noise.GridGaussian``.

    ``sensitivity`` is the bound on ``||f(x) - f(x')||`` in ``sensitivity_norm`` over neighbouring
    inputs (replace one record). ``valid = False`` marks a reproduction of a flawed calibration:
    its ``delta`` is the *claimed* one and ``dp_event`` is ``NonPrivateDpEvent`` so the accountant
    never reports a guarantee it does not have.
    """

    name: str
    epsilon: float
    delta: float
    sensitivity: float
    sensitivity_norm: Literal["l1", "l2"]
    noise: NoiseDistribution
    dp_event: dp_event.DpEvent
    valid: bool = True

    def sample(self, shape: Shape, generator: torch.Generator) -> torch.Tensor:
        """i.i.d. noise of this mechanism, float64 on ``generator.device``."""
        return self.noise.sample(shape, generator)

    @property
    def variance(self) -> float:
        """Exact per-coordinate noise variance."""
        return self.noise.variance

    def statement(self) -> str:
        """One human-readable line: the guarantee, its unit and the noise scale."""
        guarantee = (
            f"({self.epsilon:.6g}, {self.delta:.3g})-DP"
            if self.valid
            else f"NOT DP at the claimed ({self.epsilon:.6g}, {self.delta:.3g}): reproduction only"
        )
        return (
            f"{self.name}: {guarantee} per release, for neighbours whose output differs by at most "
            f"{self.sensitivity:.6g} in {self.sensitivity_norm}; noise std {math.sqrt(self.variance):.6g}"
        )


def laplace_mechanism(sensitivity_l1: float, epsilon: float) -> Mechanism:
    """Laplace mechanism: scale = sensitivity_l1 / epsilon; pure (epsilon, 0)-DP."""
    sensitivity_l1 = check_positive(sensitivity_l1, "sensitivity_l1")
    epsilon = check_epsilon(epsilon)
    scale = sensitivity_l1 / epsilon
    return Mechanism(
        name="laplace",
        epsilon=epsilon,
        delta=0.0,
        sensitivity=sensitivity_l1,
        sensitivity_norm="l1",
        noise=LaplaceNoise(scale),
        dp_event=dp_event.LaplaceDpEvent(noise_multiplier=scale / sensitivity_l1),
    )


def truncated_laplace_bound(sensitivity: float, epsilon: float, delta: float) -> float:
    """B = (Delta/eps) * log(1 + (e^eps - 1) / (2 delta)) (DP cross-attention paper, Def. 3.4)."""
    return (sensitivity / epsilon) * math.log1p(math.expm1(epsilon) / (2.0 * delta))


def truncated_laplace_mechanism(sensitivity: float, epsilon: float, delta: float) -> Mechanism:
    """TLap(Delta, eps, delta) (Def. 3.4): (eps, delta)-DP for a scalar of sensitivity Delta.

    Requires delta < 1/2 so that B >= Delta: shifting by Delta, the only region where the
    likelihood ratio exceeds e^eps is [-B, -B + Delta), whose mass
    ``(e^eps - 1) e^{-B/lambda} / (2 (1 - e^{-B/lambda}))`` (lambda = Delta/eps) is exactly
    delta for this B. Its variance is Fact 3.5:
    (2 Delta^2/eps^2) (1 - delta (a^2 + 2a)/(e^eps - 1)), a = log(1 + (e^eps - 1)/(2 delta)).
    """
    sensitivity = check_positive(sensitivity, "sensitivity")
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta)
    if delta >= 0.5:
        raise ValueError(f"truncated Laplace needs delta < 0.5 (so that B >= Delta), got {delta}")
    bound = truncated_laplace_bound(sensitivity, epsilon, delta)
    return eps_delta_laplace("truncated_laplace", epsilon, delta, sensitivity, bound)


def eps_delta_laplace(
    name: str, epsilon: float, delta: float, sensitivity_l1: float, bound: float
) -> Mechanism:
    """Laplace noise of scale sensitivity_l1/epsilon truncated at ``bound``, whose calibration
    proved (epsilon, delta)-DP; accounted as a generic (epsilon, delta) release."""
    return Mechanism(
        name=name,
        epsilon=epsilon,
        delta=delta,
        sensitivity=sensitivity_l1,
        sensitivity_norm="l1",
        noise=LaplaceNoise(sensitivity_l1 / epsilon, bound),
        dp_event=EpsilonDeltaDpEvent(epsilon, delta),
    )


def fact_3_5_variance(sensitivity: float, epsilon: float, delta: float) -> float:
    """Fact 3.5 of the DP cross-attention paper ([GDGK20] Thm 3), as printed."""
    a = math.log1p(math.expm1(epsilon) / (2.0 * delta))
    return (2.0 * sensitivity**2 / epsilon**2) * (1.0 - delta * (a * a + 2.0 * a) / math.expm1(epsilon))


GaussianCalibration = Literal["analytic", "classic"]


def gaussian_sigma(
    sensitivity_l2: float, epsilon: float, delta: float, calibration: GaussianCalibration
) -> float:
    """Noise std for an (epsilon, delta)-DP Gaussian mechanism of l2 sensitivity Delta.

    ``analytic``: the smallest sigma with Balle & Wang's exact condition (dp-accounting).
    ``classic``: Delta * sqrt(2 ln(1.25/delta)) / epsilon (Dwork & Roth Thm A.1), only for eps <= 1.
    """
    sensitivity_l2 = check_positive(sensitivity_l2, "sensitivity_l2")
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta)
    if calibration == "analytic":
        return sensitivity_l2 * float(get_sigma_gaussian(epsilon, delta))
    if calibration == "classic":
        if epsilon > 1.0:
            raise ValueError(
                f"the classic Gaussian calibration is only (eps, delta)-DP for eps <= 1, got "
                f"eps={epsilon}; use calibration='analytic'"
            )
        return sensitivity_l2 * math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon
    raise ValueError(f"unknown Gaussian calibration {calibration!r}; use 'analytic' or 'classic'")


def gaussian_mechanism(
    sensitivity_l2: float,
    epsilon: float,
    delta: float,
    calibration: GaussianCalibration = "analytic",
) -> Mechanism:
    """Gaussian mechanism calibrated to (epsilon, delta); see ``gaussian_sigma``."""
    sigma = gaussian_sigma(sensitivity_l2, epsilon, delta, calibration)
    return _gaussian(f"gaussian({calibration})", float(sensitivity_l2), sigma, float(epsilon), float(delta))


def gaussian_from_noise_multiplier(
    sensitivity_l2: float, noise_multiplier: float, delta: float, name: str = "gaussian"
) -> Mechanism:
    """Gaussian with sigma = noise_multiplier * sensitivity; states its exact analytic epsilon
    at ``delta`` (Balle & Wang, via dp-accounting)."""
    sensitivity_l2 = check_positive(sensitivity_l2, "sensitivity_l2")
    noise_multiplier = check_positive(noise_multiplier, "noise_multiplier")
    delta = check_delta(delta)
    epsilon = float(get_epsilon_gaussian(noise_multiplier, delta))
    return _gaussian(name, sensitivity_l2, noise_multiplier * sensitivity_l2, epsilon, delta)


def _gaussian(name: str, sensitivity: float, sigma: float, epsilon: float, delta: float) -> Mechanism:
    return Mechanism(
        name=name,
        epsilon=epsilon,
        delta=delta,
        sensitivity=sensitivity,
        sensitivity_norm="l2",
        noise=GaussianNoise(sigma),
        dp_event=dp_event.GaussianDpEvent(noise_multiplier=sigma / sensitivity),
    )


def warn_not_private(message: str) -> None:
    """Emit the loud warning every non-DP reproduction mode must give."""
    warnings.warn(message, NotDifferentiallyPrivateWarning, stacklevel=3)
