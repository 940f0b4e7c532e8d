"""DP partition selection: release the keys many contributors agree on, and nothing else.

Each contributor (a member of DP aggregation, holding one document) gives at most ``l0`` keys,
each once. Every key's count gets discrete Laplace noise ``Z``, ``P(Z = z) ~ q^|z|`` with
``q = exp(-1 / scale)``, and only keys whose noisy count reaches ``threshold`` are released, with
their noisy counts (Desfontaines et al. 2022; Gopi et al. 2020). The noise is sampled exactly by
OpenDP's ``make_laplace_threshold`` (integers, no floating-point noise and so no low-bit leak).

The statement is computed here from exact formulas, for add/remove of one contributor:

* a key both neighbours hold moves by 1: its noisy count (released or not) changes in
  probability by at most ``exp(1 / scale)``; over the ``l0`` keys one contributor moves,
  ``epsilon = l0 / scale``;
* a key only one neighbour holds has count 1 there and is released with probability
  ``P(1 + Z >= threshold) = q^(threshold - 1) / (1 + q)``; over ``l0`` such keys,
  ``delta = l0 q^(threshold - 1) / (1 + q)``.

(OpenDP 0.16's own privacy map of this measurement states a delta of ``q^threshold / (1 + q)``
for the same change, one step smaller than the release probability its sampler shows for a
count of 1 (``tests/privacy/test_partition_selection.py`` measures both), so it is not used.)

``ThresholdRelease.calibrated(epsilon, delta, l0)``: scale ``l0 / epsilon`` rounded up to a
multiple of ``2^-20`` (a rational the keyed sampler draws exactly; the statement is computed from
the scale used, so its epsilon is at most the one asked for) and the smallest threshold whose
delta is at most ``delta``.

Two samplers, one law: ``release`` draws fresh noise with OpenDP's ``make_laplace_threshold``
(a per-query release); ``keyed_release`` draws it from a caller's generator with the project's
exact integer sampler (``noise.discrete_laplace``, CKS Alg. 2), so a one-shot release keyed by
the deployment's secret key (a fact sheet) is reproduced exactly by a restart.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

import torch

from .accountant import Budget
from .noise import discrete_laplace
from .validation import check_count, check_delta, check_epsilon, check_positive

SCALE_GRID = 1 << 20  # calibrated scales are multiples of 1 / SCALE_GRID (exact rationals for the keyed sampler)


@functools.lru_cache(maxsize=256)
def _measurement(scale: float, threshold: int):
    """OpenDP's Laplace threshold over ``{key: count}`` (integer counts): the exact sampler."""
    import opendp.prelude as dp

    dp.enable_features("contrib")
    domain = dp.map_domain(dp.atom_domain(T=str), dp.atom_domain(T=int))
    metric = dp.l01inf_distance(dp.absolute_distance(T=int))
    return dp.m.make_laplace_threshold(domain, metric, scale=scale, threshold=threshold)


def tail(scale: float, k: int) -> float:
    """``P(Z >= k)`` for discrete Laplace noise of ``scale`` and an integer ``k >= 1``:
    ``q^k / (1 + q)``, ``q = exp(-1 / scale)`` (float64)."""
    q = math.exp(-1.0 / scale)
    return q ** k / (1.0 + q)


def _check_counts(counts: Mapping[str, int]) -> None:
    for key, count in counts.items():
        if not isinstance(key, str) or not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"counts must map str keys to ints >= 0, got {key!r}: {count!r}")


@dataclass(frozen=True)
class ThresholdRelease:
    """Discrete Laplace noise of ``scale`` on each key's count, keys below ``threshold`` (>= 2)
    dropped; one contributor changes at most ``l0`` keys' counts, each by at most 1."""

    scale: float
    threshold: int
    l0: int = 1

    def __post_init__(self) -> None:
        check_positive(self.scale, "scale")
        check_count(self.l0, "l0")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) or self.threshold < 2:
            raise ValueError(f"threshold must be an integer >= 2 (a key one contributor gives must need noise), "
                             f"got {self.threshold!r}")

    @classmethod
    def calibrated(cls, epsilon: float, delta: float, l0: int = 1) -> ThresholdRelease:
        """Scale ``l0 / epsilon`` and the smallest threshold with delta <= ``delta``."""
        check_epsilon(epsilon, "epsilon")
        check_delta(delta, "delta")
        check_count(l0, "l0")
        scale = math.ceil(l0 / epsilon * SCALE_GRID) / SCALE_GRID
        q = math.exp(-1.0 / scale)
        steps = max(1, math.ceil(scale * math.log(l0 / (delta * (1.0 + q))) - 1e-12))  # q^steps/(1+q) <= delta/l0
        while l0 * tail(scale, steps) > delta:  # rounding in the log's last place
            steps += 1
        return cls(scale, steps + 1, l0)

    @property
    def budget(self) -> Budget:
        """(eps, delta) of one release for add/remove of one contributor (module docstring)."""
        return Budget(self.l0 / self.scale, self.l0 * tail(self.scale, self.threshold - 1))

    def release(self, counts: Mapping[str, int]) -> dict[str, int]:
        """The keys whose noisy count reaches the threshold, with their noisy counts (fresh
        noise from OpenDP's generator). ``counts``: key -> contributors (ints >= 0)."""
        _check_counts(counts)
        return dict(_measurement(self.scale, self.threshold)(dict(counts)))

    def keyed_release(self, counts: Mapping[str, int], generator: torch.Generator) -> dict[str, int]:
        """As ``release``, the noise drawn exactly from ``generator`` (a keyed one: the same
        generator and counts give the same release), one draw per key in sorted key order."""
        _check_counts(counts)
        keys = sorted(counts)
        if not keys:
            return {}
        scale = Fraction(self.scale)
        if scale.denominator > SCALE_GRID:
            raise ValueError(f"keyed_release needs a scale on the 1/{SCALE_GRID} grid (ThresholdRelease.calibrated), "
                             f"got {self.scale!r}")
        noise = discrete_laplace(scale, len(keys), generator).tolist()
        noisy = {k: counts[k] + z for k, z in zip(keys, noise, strict=True)}
        return {k: v for k, v in noisy.items() if v >= self.threshold}

    def statement(self) -> str:
        b = self.budget
        return (f"Laplace partition selection (exact discrete noise): scale {self.scale:.4g}, threshold "
                f"{self.threshold}, {self.l0} key(s) per contributor: ({b.epsilon:.4g}, {b.delta:.3g})-DP per release")
