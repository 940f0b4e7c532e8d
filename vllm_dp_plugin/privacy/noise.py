"""Noise laws: exact float64 samplers, CDFs and variances.

Every sampler draws from a caller-supplied ``torch.Generator`` (so keyed noise is reproducible)
and returns float64 on the generator's device. Two laws cover every mechanism in the project:

* ``LaplaceNoise(scale, bound)``: density proportional to ``exp(-|z| / scale)`` on
  ``[-bound, bound]``; ``bound = inf`` is the plain Laplace law. The 1-D truncated Laplace of the
  DP cross-attention paper (Def. 3.4) and every TrLaplace calibration are this law with different
  (scale, bound).
* ``GaussianNoise(sigma)``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
from scipy import special

from .validation import check_positive

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
    independent Rademacher sign (trlaplace spec S12), never rejection.
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
        """scale^2 * (2 - L(L+2)/expm1(L)), L = bound/scale (trlaplace spec S11; Fact 3.5)."""
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
# CPU and CUDA) and use integer arithmetic only, so their laws are exact (Canonne, Kamath &
# Steinke 2020, "CKS"). Every loop is vectorised over the pending slots; the number of rounds is
# random (geometric tails) and independent of any private value.

_DRAW_RANGE = 1 << 62
GRID_RATIO = 1024  # GridGaussian: grid units per clip norm >= GRID_RATIO sqrt(d)
MAX_GRID_SIGMA = 1 << 40  # keeps every intermediate of the integer samplers far inside int64


def uniform_below(n: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Exactly uniform integers in ``[0, n)``, elementwise; ``n: [m]`` int64 in ``[1, 2^62]`` on
    ``generator.device``. A 62-bit draw is kept when it lies below the largest multiple of n in
    range (rejection) and reduced mod n."""
    limit = _DRAW_RANGE - torch.remainder(torch.full_like(n, _DRAW_RANGE), n)

    def propose(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        draw = torch.randint(0, _DRAW_RANGE, slots.shape, generator=generator, device=generator.device)
        return torch.remainder(draw, n[slots]), draw < limit[slots]

    return _rejection(n.numel(), propose, generator.device)


def _rejection(m: int, propose, device: torch.device) -> torch.Tensor:
    """``[m]`` int64 by rejection: ``propose(slots)`` returns candidates for the pending ``slots``
    and which of them are accepted; rejected slots get fresh, independent proposals."""
    out = torch.zeros(m, dtype=torch.int64, device=device)
    pending = torch.arange(m, device=device)
    while pending.numel():
        value, accepted = propose(pending)
        out[pending[accepted]] = value[accepted]
        pending = pending[~accepted]
    return out


def _successes(m: int, trial, device: torch.device, cap: torch.Tensor | None = None) -> torch.Tensor:
    """``[m]``: per slot, the number of successes of independent trials before the first failure,
    stopping at ``cap`` (int64 ``[m]``) if given. ``trial(slots, count)`` returns one bool draw
    per pending slot, given the successes so far."""
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


def _bernoulli(num: torch.Tensor, den: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Bernoulli(num / den) exactly, elementwise (``0 <= num <= den``, int64 ``[m]``)."""
    return uniform_below(den, generator) < num


def _bernoulli_exp(
    fractions: list[tuple[torch.Tensor, torch.Tensor]], scale: int, m: int, generator: torch.Generator
) -> torch.Tensor:
    """``[m]`` Bernoulli(exp(-x)) for ``x = prod(num / den) / scale`` in [0, 1], each fraction a
    pair of int64 ``[m]`` (CKS Alg. 1): count K = 1, 2, ... while Bernoulli(x / K) succeeds;
    P(K ends odd) = exp(-x). Bernoulli(x / K) is the AND of independent Bernoulli(num / den) and
    Bernoulli(1 / (scale K))."""
    device = generator.device

    def trial(slots: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        ok = _bernoulli(torch.ones_like(slots), scale * (count + 1), generator)
        for num, den in fractions:
            ok &= _bernoulli(num[slots], den[slots], generator)
        return ok

    return _successes(m, trial, device) % 2 == 0


def _bernoulli_exp_power(
    fractions: list[tuple[torch.Tensor, torch.Tensor]],
    scale: int,
    times: torch.Tensor,
    generator: torch.Generator,
) -> torch.Tensor:
    """Bernoulli(exp(-times x)) elementwise: ``times: [m]`` independent Bernoulli(exp(-x)) (x as
    in ``_bernoulli_exp``) all succeed."""
    m = times.numel()

    def trial(slots: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return _bernoulli_exp([(num[slots], den[slots]) for num, den in fractions], scale, slots.numel(), generator)

    return _successes(m, trial, generator.device, cap=times) == times


def discrete_laplace(scale: int, m: int, generator: torch.Generator) -> torch.Tensor:
    """``[m]`` int64 with P(y) proportional to exp(-|y| / scale), ``scale`` an integer >= 1 (CKS
    Alg. 2): U uniform in [0, scale) kept with probability exp(-U / scale), plus scale V with V
    geometric (P(V = v) = (1 - 1/e) e^-v), a random sign, -0 rejected."""
    device = generator.device

    def propose(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = slots.numel()
        t = torch.full((k,), scale, dtype=torch.int64, device=device)
        u = uniform_below(t, generator)
        kept = _bernoulli_exp([(u, t)], 1, k, generator)
        v = _successes(k, lambda s, c: _bernoulli_exp([], 1, s.numel(), generator), device)
        negative = uniform_below(torch.full_like(t, 2), generator) == 1
        y = u + scale * v
        return torch.where(negative, -y, y), kept & ~(negative & (y == 0))

    return _rejection(m, propose, device)


def discrete_gaussian(sigma: int, shape: Shape, generator: torch.Generator) -> torch.Tensor:
    """i.i.d. draws of the discrete Gaussian N_Z(0, sigma^2), P(y) proportional to
    exp(-y^2 / (2 sigma^2)) on the integers, ``sigma`` an integer in [1, 2^40]: int64 on
    ``generator.device``, exact (CKS Alg. 3, Laplace scale = sigma). A Laplace draw y is kept with
    probability exp(-(|y| - sigma)^2 / (2 sigma^2)) = exp(-k^2/2) exp(-k r/sigma) exp(-(r/sigma)^2/2)
    where ||y| - sigma| = k sigma + r, 0 <= r < sigma: three exact Bernoullis with denominators
    <= 2 sigma (no product of large integers)."""
    if isinstance(sigma, bool) or not isinstance(sigma, int) or not 1 <= sigma <= MAX_GRID_SIGMA:
        raise ValueError(f"discrete Gaussian sigma must be an integer in [1, 2^40], got {sigma!r}")
    device = generator.device

    def propose(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = slots.numel()
        y = discrete_laplace(sigma, k, generator)
        t = torch.full_like(y, sigma)
        distance = (y.abs() - t).abs()
        whole, r = distance // t, distance % t
        half = _bernoulli_exp([], 2, k, generator) | (whole % 2 == 0)  # exp(-1/2) for odd k^2
        accept = half & _bernoulli_exp_power([], 1, whole * whole // 2, generator)
        accept &= _bernoulli_exp_power([(r, t)], 1, whole, generator)
        accept &= _bernoulli_exp([(r, t), (r, t)], 2, k, generator)
        return y, accept

    return _rejection(math.prod(shape), propose, device).view(shape)
