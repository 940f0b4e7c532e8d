"""Noise laws: exact float64 samplers, CDFs and variances; exact integer samplers for releases
that must not leak through floating point.

Every sampler draws from a caller-supplied ``torch.Generator`` (so keyed noise is reproducible)
and returns its draws on the generator's device. Two float64 laws cover every mechanism in the
project:

* ``LaplaceNoise(scale, bound)``: density proportional to ``exp(-|z| / scale)`` on
  ``[-bound, bound]``; ``bound = inf`` is the plain Laplace law. The 1-D truncated Laplace of the
  DP cross-attention paper (Def. 3.4) and every TrLaplace calibration are this law with different
  (scale, bound).
* ``GaussianNoise(sigma)``.

``f(x) + z`` with such a float z is not DP as computed (``mechanisms``, "Floating point"). The
integer samplers (``discrete_gaussian``) and ``GridGaussian`` (a grid release with discrete
Gaussian noise, the trainer's ``secure_mode``) draw and compute with integers only.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from scipy import special

from .validation import check_count, check_positive

Shape = tuple[int, ...] | torch.Size


class NoiseDistribution(ABC):
    """A zero-mean, symmetric noise law with an exact sampler."""

    @abstractmethod
    def sample(self, shape: Shape, generator: torch.Generator) -> torch.Tensor:
        """i.i.d. draws, float64, on ``generator.device``."""

    @abstractmethod
    def cdf(self, x: np.ndarray) -> np.ndarray:
        """Exact cumulative distribution function, evaluated elementwise in float64."""

    @property
    @abstractmethod
    def variance(self) -> float:
        """Exact variance of one coordinate."""

    @property
    @abstractmethod
    def bound(self) -> float:
        """Deterministic bound on ``|z|`` (``inf`` if unbounded)."""


def _uniform(shape: Shape, generator: torch.Generator) -> torch.Tensor:
    """U[0, 1) in float64 (53 random bits per draw)."""
    return torch.rand(shape, generator=generator, dtype=torch.float64, device=generator.device)


def _random_sign(shape: Shape, generator: torch.Generator) -> torch.Tensor:
    bits = torch.randint(0, 2, shape, generator=generator, device=generator.device)
    return bits.to(torch.float64) * 2.0 - 1.0


@dataclass(frozen=True)
class LaplaceNoise(NoiseDistribution):
    """Laplace law of ``scale`` (= 1/alpha), optionally truncated to ``[-bound, bound]``.

    Truncation mass parameter ``p = 1 - exp(-bound/scale)`` (p = 1 when untruncated).
    Sampling is the exact inverse CDF of ``|z|``: ``|z| = -scale * log1p(-p U)`` with an
    independent Rademacher sign (|z| has CDF ``(1 - e^{-x/scale}) / p`` on [0, bound], and the
    density is even), never rejection: the same law as the TrLaplace paper's rejection sampler.
    """

    scale: float
    bound: float = math.inf

    def __post_init__(self) -> None:
        check_positive(self.scale, "scale")
        if not (self.bound > 0):  # also rejects NaN
            raise ValueError(f"bound must be > 0 (or inf), got {self.bound!r}")

    @property
    def truncation_mass(self) -> float:
        """p = 1 - exp(-bound/scale), computed without cancellation."""
        return -math.expm1(-self.bound / self.scale)

    def sample(self, shape: Shape, generator: torch.Generator) -> torch.Tensor:
        sign = _random_sign(shape, generator)
        magnitude = -self.scale * torch.log1p(-self.truncation_mass * _uniform(shape, generator))
        return sign * magnitude

    def cdf(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        clipped = np.clip(np.abs(x), 0.0, self.bound)
        magnitude_cdf = -np.expm1(-clipped / self.scale) / self.truncation_mass
        return 0.5 + 0.5 * np.sign(x) * magnitude_cdf

    @property
    def variance(self) -> float:
        """scale^2 * (2 - L(L+2)/expm1(L)), L = bound/scale (integration by parts; equal to the
        DP cross-attention paper's Fact 3.5)."""
        if math.isinf(self.bound):
            return 2.0 * self.scale**2
        ratio = self.bound / self.scale
        tail = 0.0 if ratio > 700 else ratio * (ratio + 2.0) / math.expm1(ratio)
        return self.scale**2 * (2.0 - tail)


@dataclass(frozen=True)
class GaussianNoise(NoiseDistribution):
    """Centred normal law of standard deviation ``sigma``."""

    sigma: float

    def __post_init__(self) -> None:
        check_positive(self.sigma, "sigma")

    def sample(self, shape: Shape, generator: torch.Generator) -> torch.Tensor:
        return self.sigma * torch.randn(
            shape, generator=generator, dtype=torch.float64, device=generator.device
        )

    def cdf(self, x: np.ndarray) -> np.ndarray:
        return special.ndtr(np.asarray(x, dtype=np.float64) / self.sigma)

    @property
    def variance(self) -> float:
        return self.sigma**2

    @property
    def bound(self) -> float:
        return math.inf


# ---------- exact integer sampling: releases without a floating-point leak ----------
# A float release ``fl(f(x) + z)`` leaks f(x) through its low-order bits (Mironov 2012): the set
# of floats it can take depends on f(x). The samplers below never touch a float: they draw
# 62-bit integers (torch serves a range of 2^62 as ``random64() % 2^62``, exactly uniform, on
# CPU and CUDA) and use integer arithmetic only (Canonne, Kamath & Steinke 2020, "CKS"). Loops
# are vectorised over the pending slots; how many rounds they take is random and independent of
# any private value. Every intermediate stays below 2^62 while the CKS counter K < 2^21 and the
# geometric count V < 2^22, i.e. except with probability < 1/(2^21)! + e^-(2^22) per draw: the
# laws are exact up to that.

_DRAW_RANGE = 1 << 62
MAX_GRID_SIGMA = 1 << 40  # denominators <= 2 sigma <= 2^41, times K < 2^21
_OVERSAMPLE = 1.1  # i.i.d. rejection proposes this many times the expected need (fewer rounds)

IntFraction = tuple[torch.Tensor, torch.Tensor]  # (num, den): int64 [m], 0 <= num <= den


def uniform_below(n: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Exactly uniform integers in ``[0, n)``, elementwise; ``n: [m]`` int64 in ``[1, 2^62]`` on
    ``generator.device``. A 62-bit draw is kept when below the largest multiple of n in range and
    reduced mod n; rejected slots draw again."""
    draw = torch.randint(0, _DRAW_RANGE, n.shape, generator=generator, device=generator.device)
    out = torch.remainder(draw, n)
    limit = _DRAW_RANGE - torch.remainder(torch.full_like(n, _DRAW_RANGE), n)
    rejected = (draw >= limit).nonzero().view(-1)
    if rejected.numel():
        out[rejected] = uniform_below(n[rejected], generator)
    return out


def _bernoulli(num: torch.Tensor, den: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Bernoulli(num / den) exactly, elementwise."""
    return uniform_below(den, generator) < num


def _successes(m: int, trial, device: torch.device, cap: torch.Tensor | None = None) -> torch.Tensor:
    """``[m]``: per slot, the number of successes of independent trials before the first failure,
    stopping at ``cap`` (int64 ``[m]``) if given. ``trial(slots, count)`` returns one bool draw
    per pending slot, given its successes so far."""
    count = torch.zeros(m, dtype=torch.int64, device=device)
    pending = torch.arange(m, device=device)
    if cap is not None:
        pending = pending[cap > 0]
    while pending.numel():
        pending = pending[trial(pending, count[pending])]
        count[pending] += 1
        if cap is not None:
            pending = pending[count[pending] < cap[pending]]
    return count


def _bernoulli_exp(fractions: list[IntFraction], generator: torch.Generator) -> torch.Tensor:
    """``[m]`` Bernoulli(exp(-x)), ``x = prod(num / den)`` in [0, 1] (CKS Alg. 1): count
    K = 1, 2, ... while Bernoulli(x / K) succeeds; P(K ends odd) = exp(-x). Bernoulli(x / K) is
    the AND of independent Bernoulli(num / den) over the fractions, the last one's den times K."""
    *first, (last_num, last_den) = fractions

    def trial(slots: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        ok = _bernoulli(last_num[slots], last_den[slots] * (count + 1), generator)
        for num, den in first:
            ok &= _bernoulli(num[slots], den[slots], generator)
        return ok

    return _successes(last_num.numel(), trial, generator.device) % 2 == 0


def _bernoulli_exp_power(
    fractions: list[IntFraction], times: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """Bernoulli(exp(-times x)) elementwise: ``times: [m]`` independent Bernoulli(exp(-x)) (x as
    in ``_bernoulli_exp``) all succeed."""

    def trial(slots: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return _bernoulli_exp([(num[slots], den[slots]) for num, den in fractions], generator)

    return _successes(times.numel(), trial, generator.device, cap=times) == times


def _iid_rejection(m: int, propose, acceptance: float) -> torch.Tensor:
    """``[m]``: the first m accepted values of i.i.d. proposals; ``propose(k)`` returns ``k``
    candidates and which are accepted (about ``acceptance`` of them: it only sizes the
    proposals). Which accepted values are kept depends only on their count, so they are i.i.d.
    from the target."""
    parts, have = [], 0
    while have < m:
        values, accepted = propose(math.ceil((m - have) * _OVERSAMPLE / acceptance) + 16)
        parts.append(values[accepted])
        have += parts[-1].numel()
    return torch.cat(parts)[:m]


def discrete_laplace(scale: int | Fraction, m: int, generator: torch.Generator) -> torch.Tensor:
    """``[m]`` int64 with P(y) proportional to exp(-|y| / scale), ``scale = t / s`` a positive
    rational (an int, or a ``Fraction`` with t <= 2^40 and s <= 2^21) (CKS Alg. 2): U uniform in
    [0, t) kept with probability exp(-U / t), plus t V with P(V = v) = (1 - 1/e) e^-v, divided by
    s (floor), a random sign, -0 rejected."""
    scale = Fraction(scale)
    t, s = scale.numerator, scale.denominator
    if not (0 < t <= 1 << 40 and s <= 1 << 21):
        raise ValueError(f"discrete_laplace: scale {scale} = t/s needs 0 < t <= 2^40 and s <= 2^21")

    def propose(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        full = torch.full((k,), t, dtype=torch.int64, device=generator.device)
        u = uniform_below(full, generator)
        kept = _bernoulli_exp([(u, full)], generator)
        one = torch.ones_like(full)

        def exp_minus_one(slots: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
            return _bernoulli_exp([(one[slots], one[slots])], generator)

        v = _successes(k, exp_minus_one, generator.device)
        negative = uniform_below(one + 1, generator) == 1
        y = torch.div(u + t * v, s, rounding_mode="floor")
        return torch.where(negative, -y, y), kept & ~(negative & (y == 0))

    return _iid_rejection(m, propose, acceptance=1 - math.exp(-1))


def discrete_gaussian(sigma: int, shape: Shape, generator: torch.Generator) -> torch.Tensor:
    """i.i.d. draws of the discrete Gaussian N_Z(0, sigma^2), P(y) proportional to
    exp(-y^2 / (2 sigma^2)) on the integers, ``sigma`` an integer in [1, 2^40]: int64 on
    ``generator.device`` (CKS Alg. 3 with Laplace scale sigma). A Laplace draw y is kept with
    probability exp(-(|y| - sigma)^2 / (2 sigma^2)) = exp(-k^2/2) exp(-k r/sigma) exp(-r^2/(2 sigma^2))
    where ||y| - sigma| = k sigma + r, 0 <= r < sigma: exact Bernoullis whose denominators are
    at most 2 sigma (no product of large integers)."""
    if isinstance(sigma, bool) or not isinstance(sigma, int) or not 1 <= sigma <= MAX_GRID_SIGMA:
        raise ValueError(f"discrete Gaussian sigma must be an integer in [1, 2^40], got {sigma!r}")

    def propose(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = discrete_laplace(sigma, k, generator)
        t = torch.full_like(y, sigma)
        distance = (y.abs() - t).abs()
        whole, r = distance // t, distance % t
        one = torch.ones_like(y)
        accept = _bernoulli_exp([(one, one + 1)], generator) | (whole % 2 == 0)  # exp(-1/2) if k^2 is odd
        accept &= _bernoulli_exp_power([(one, one)], whole * whole // 2, generator)
        accept &= _bernoulli_exp_power([(r, t)], whole, generator)
        accept &= _bernoulli_exp([(r, t), (r, 2 * t)], generator)
        return y, accept

    return _iid_rejection(math.prod(shape), propose, acceptance=0.7).view(shape)


GRID_RATIO = 1024  # GridGaussian: grid steps per clip norm >= GRID_RATIO sqrt(d)
_EXACT_INTEGERS = float(1 << 52)  # |k| <= 2^52: k, and gamma k, are exact in float64


@dataclass(frozen=True)
class GridGaussian:
    """A Gaussian release with no floating-point leak (Canonne, Kamath & Steinke 2020):
    ``values: [*]`` (L2 sensitivity C over its d coordinates) is released as
    ``gamma * (round(values / gamma) + Z)``, Z i.i.d. ``discrete_gaussian(sigma)``, on the grid
    ``gamma = 2^-exponent``. The release is a function of the integer vector
    ``k = round(values / gamma) + Z`` alone (each float is exactly ``gamma k`` while |k| < 2^53),
    so a float can reveal nothing that k does not.

    Guarantee. Rounding moves each coordinate by <= 1/2, so the centres round(values / gamma) of
    neighbours differ by an integer vector of L2 norm <= C / gamma + sqrt(d) <= ``sensitivity``
    = ceil(C / gamma) + ceil(sqrt(d)) grid steps (exact arithmetic on the inputs' values). The
    discrete Gaussian with integer shifts has the Renyi divergences of the continuous Gaussian at
    every order, D_alpha <= alpha Delta^2 / (2 sigma^2) (CKS: its theta function peaks at 0), so
    one release is (Delta^2 / (2 sigma^2))-zCDP with noise multiplier sigma / Delta >= the one
    asked for. Its (epsilon, delta) curve is NOT the Gaussian's (the lattice makes it worse at
    some epsilon), so account it in Renyi DP (see ``trainer.accounting``, ``rdp_integer``), not
    with the Gaussian's PLD or analytic calibration. Values are clamped to +-2^52 grid steps
    first (1-Lipschitz per coordinate: the sensitivity bound survives).

    Cost: the noise std in value units is ``noise_std`` = gamma sigma ~ noise_multiplier x
    (C + gamma sqrt(d)) <= (1 + 1/GRID_RATIO) x the continuous mechanism's (plus the rounding up
    of sigma to an integer); sampling takes ~28 62-bit draws and ~0.5 KiB of transient int64
    memory per coordinate (release long vectors in chunks).
    """

    exponent: int
    sigma: int
    sensitivity: int  # grid steps: ceil(C / gamma) + ceil(sqrt(d))

    @classmethod
    def calibrate(cls, sensitivity_l2: float, noise_multiplier: float, dim: int) -> GridGaussian:
        """The grid 2^-e with the smallest e such that C / gamma >= GRID_RATIO ceil(sqrt(dim)), and
        the smallest integer sigma with sigma / sensitivity >= ``noise_multiplier`` (exact
        rational arithmetic)."""
        clip = Fraction(check_positive(sensitivity_l2, "sensitivity_l2"))
        multiplier = Fraction(check_positive(noise_multiplier, "noise_multiplier"))
        root = math.isqrt(check_count(dim, "dim"))
        root += root * root < dim
        exponent = math.ceil(math.log2(GRID_RATIO * root / float(clip)))
        while clip * Fraction(2) ** exponent < GRID_RATIO * root:
            exponent += 1
        while clip * Fraction(2) ** (exponent - 1) >= GRID_RATIO * root:
            exponent -= 1
        sensitivity = math.ceil(clip * Fraction(2) ** exponent) + root
        sigma = math.ceil(multiplier * sensitivity)
        if sigma > MAX_GRID_SIGMA:
            raise ValueError(
                f"secure release: noise_multiplier {noise_multiplier} over {dim} coordinates needs a "
                f"discrete Gaussian sigma of {sigma} grid steps > 2^40"
            )
        return cls(exponent, sigma, sensitivity)

    @property
    def grid(self) -> float:
        """gamma = 2^-exponent."""
        return math.ldexp(1.0, -self.exponent)

    @property
    def noise_multiplier(self) -> float:
        """sigma / sensitivity: at least the requested noise multiplier."""
        return self.sigma / self.sensitivity

    @property
    def noise_std(self) -> float:
        """Per-coordinate noise std in value units, gamma sigma (the discrete Gaussian's variance
        is at most sigma^2)."""
        return math.ldexp(float(self.sigma), -self.exponent)

    def report(self) -> dict:
        """The release's parameters, JSON-ready."""
        return {
            "mechanism": "values rounded to the grid 2^-exponent plus discrete Gaussian noise (CKS 2020)",
            "grid_exponent": self.exponent,
            "sigma_grid_steps": self.sigma,
            "sensitivity_grid_steps": self.sensitivity,
            "noise_multiplier": self.noise_multiplier,
            "noise_std": self.noise_std,
        }

    def release(self, values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``values: [*]`` finite floats -> float64 ``[*]`` on values' device: gamma (round(values
        / gamma) + Z), Z drawn from ``generator``. ValueError if a value is not finite."""
        steps = values.to(torch.float64) * math.ldexp(1.0, self.exponent)  # exact: a power of two
        if not torch.isfinite(steps).all():
            raise ValueError("secure release of a non-finite value (NaN/inf gradients?)")
        k = torch.round(steps.clamp(-_EXACT_INTEGERS, _EXACT_INTEGERS)).to(torch.int64)
        k += discrete_gaussian(self.sigma, tuple(values.shape), generator).to(k.device)
        return k.to(torch.float64) * self.grid
