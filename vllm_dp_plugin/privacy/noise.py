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
