"""A DpEvent for mechanisms known only through their (epsilon, delta) guarantee.

dp-accounting describes mechanisms with ``DpEvent`` objects; it has Gaussian and Laplace events
but none for "some (epsilon, delta)-DP mechanism" such as the truncated Laplace. This event fills
that gap; ``accountant.PLDAccountantWithEpsilonDelta`` composes it with the optimal PLD of a
generic (epsilon, delta)-DP mechanism (Kairouz, Oh, Viswanath 2015).
"""

from __future__ import annotations

import attr
from dp_accounting import dp_event


@attr.s(frozen=True, slots=True, auto_attribs=True)
class EpsilonDeltaDpEvent(dp_event.DpEvent):
    """A mechanism that is (epsilon, delta)-DP and about which nothing more is assumed."""

    epsilon: float
    delta: float
