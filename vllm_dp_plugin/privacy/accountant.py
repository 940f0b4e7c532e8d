"""Privacy accounting on dp-accounting: compose releases, split budgets, report what was spent.

Compositions:
* ``basic``: epsilons and deltas add (Dwork & Roth Thm 3.16). Always valid.
* ``advanced``: the optimal advanced composition theorem (Kairouz, Oh, Viswanath 2015, Thm 3.3,
  dp-accounting's ``advanced_composition``) for k identical (eps, delta) releases; reported as
  the minimum with basic composition.
* ``pld``: dp-accounting's privacy-loss-distribution accountant (Gaussian and Laplace exactly;
  any other (eps, delta) mechanism through its generic worst-case PLD).
* ``rdp``: dp-accounting's Renyi accountant (Gaussian and Laplace releases only).

Each release is accounted as a shift of its stated sensitivity (replace-one neighbours), which
is the dominating pair dp-accounting uses for its Gaussian and Laplace events.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from dp_accounting import dp_event, mechanism_calibration
from dp_accounting.gaussian_mechanism import get_sigma_gaussian
from dp_accounting.pld import accountant as pld_theorems
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant

from .events import EpsilonDeltaDpEvent
from .mechanisms import Mechanism
from .validation import check_count, check_delta, check_epsilon

Composition = Literal["basic", "advanced", "pld", "rdp"]
COMPOSITIONS: tuple[str, ...] = ("basic", "advanced", "pld", "rdp")


@dataclass(frozen=True)
class Budget:
    """An (epsilon, delta) pair; ``epsilon = inf`` means no guarantee."""

    epsilon: float
    delta: float

    def __str__(self) -> str:
        return f"(eps={self.epsilon:.6g}, delta={self.delta:.3g})"


class PLDAccountantWithEpsilonDelta(pld_privacy_accountant.PLDAccountant):
    """dp-accounting's PLD accountant, also composing ``EpsilonDeltaDpEvent`` optimally."""

    def _maybe_compose(self, event, count, do_compose):
        if not isinstance(event, EpsilonDeltaDpEvent):
            return super()._maybe_compose(event, count, do_compose)
        if do_compose:
            params = pld_common.DifferentialPrivacyParameters(event.epsilon, event.delta)
            pld = pld_lib.from_privacy_parameters(
                params, value_discretization_interval=self._value_discretization_interval
            )
            self._pld = self._pld.compose(pld.self_compose(count))
        return None


@dataclass
class Release:
    """``count`` identical releases of ``mechanism``, labelled for reports."""

    label: str
    mechanism: Mechanism
    count: int


@dataclass
class PrivacyLedger:
    """Records releases and reports the (epsilon, delta) actually spent under ``composition``.

    ``target_delta`` is the total delta at which ``pld``/``rdp`` report epsilon (for
    ``advanced`` it includes the theorem's slack); ``basic`` reports the sum of deltas.
    """

    composition: Composition = "pld"
    target_delta: float = 1e-6
    releases: list[Release] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.composition not in COMPOSITIONS:
            raise ValueError(f"unknown composition {self.composition!r}; use one of {COMPOSITIONS}")
        check_delta(self.target_delta, "target_delta")

    def record(self, mechanism: Mechanism, count: int = 1, label: str = "") -> None:
        """Add ``count`` releases of ``mechanism``."""
        self.releases.append(Release(label or mechanism.name, mechanism, check_count(count, "count")))

    @property
    def all_valid(self) -> bool:
        return all(r.mechanism.valid for r in self.releases)

    def spent(self) -> Budget:
        """Total (epsilon, delta); epsilon is inf if any release carries no guarantee."""
        if not self.releases:
            return Budget(0.0, 0.0)
        if not self.all_valid:
            return Budget(math.inf, 1.0)
        if self.composition == "basic":
            return Budget(
                sum(r.mechanism.epsilon * r.count for r in self.releases),
                sum(r.mechanism.delta * r.count for r in self.releases),
            )
        if self.composition == "advanced":
            return self._advanced()  # advanced_epsilon is never above the basic sum
        return Budget(self._dp_accounting_epsilon(), self.target_delta)

    def _advanced(self) -> Budget:
        kinds = {(r.mechanism.epsilon, r.mechanism.delta) for r in self.releases}
        if len(kinds) != 1:
            raise ValueError("advanced composition needs identical releases; use 'pld'")
        (eps, delta), k = kinds.pop(), sum(r.count for r in self.releases)
        return Budget(advanced_epsilon(eps, delta, k, self.target_delta), self.target_delta)

    def _dp_accounting_epsilon(self) -> float:
        accountant = _make_accountant(self.composition)
        for release in self.releases:
            event = dp_event.SelfComposedDpEvent(release.mechanism.dp_event, release.count)
            if not accountant.supports(event):
                raise ValueError(
                    f"{self.composition} accounting does not support {release.mechanism.name}; "
                    "use 'pld' or 'basic'"
                )
            accountant.compose(event)
        return float(accountant.get_epsilon(self.target_delta))

    def report(self) -> str:
        """Multi-line report: each release's guarantee, then the composed total."""
        lines = [
            f"  {r.count} x {r.label}: {r.mechanism.statement()}" for r in self.releases
        ]
        lines.append(f"  total ({self.composition} composition): {self.spent()}")
        return "\n".join(lines)


def _make_accountant(composition: Composition):
    if composition == "pld":
        return PLDAccountantWithEpsilonDelta()
    return rdp_privacy_accountant.RdpAccountant()


def advanced_epsilon(epsilon: float, delta: float, k: int, total_delta: float) -> float:
    """Total epsilon of k (epsilon, delta)-DP releases at total delta ``total_delta``.

    The minimum of two valid bounds: dp-accounting's optimal advanced composition (Kairouz, Oh,
    Viswanath Thm 3.3; it overflows for large k, then it is skipped) and Dwork-Rothblum-Vadhan
    (the DP cross-attention paper's Thm A.10): eps sqrt(2k ln(1/delta')) + k eps (e^eps - 1)
    with delta' = total_delta - k delta. ``inf`` when k delta >= total_delta.
    """
    slack = total_delta - k * delta
    if slack <= 0:
        return math.inf
    # e^eps overflows a float beyond eps ~ 709: the bound is then inf (still valid, never fits)
    growth = math.expm1(epsilon) if epsilon < 700 else math.inf
    drv = epsilon * math.sqrt(2 * k * math.log(1 / slack)) + k * epsilon * growth
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            optimal = pld_theorems.advanced_composition(
                pld_common.DifferentialPrivacyParameters(epsilon, delta), k, total_delta
            )
    except OverflowError:
        optimal = None
    return min(drv, k * epsilon, math.inf if optimal is None else float(optimal))


def split_budget(
    total: Budget, releases: int, composition: Composition = "basic"
) -> Budget:
    """Per-release (epsilon, delta) so that ``releases`` identical (eps, delta)-DP releases
    compose to at most ``total`` under ``composition`` (basic or advanced).

    basic: (eps/k, delta/k). advanced: per-release delta = delta/(2k), the other half of delta is
    the theorem's slack, and eps is the largest one dp-accounting's optimal advanced composition
    admits (never smaller than the basic split). Mechanism-specific splits (Gaussian under PLD/RDP)
    use ``calibrate_noise_multiplier`` instead.
    """
    check_epsilon(total.epsilon, "total epsilon")
    check_delta(total.delta, "total delta")
    k = check_count(releases, "releases")
    if composition == "basic":
        return Budget(total.epsilon / k, total.delta / k)
    if composition == "advanced":
        per_delta = total.delta / (2 * k)
        basic_eps = total.epsilon / k
        fits = lambda eps: advanced_epsilon(eps, per_delta, k, total.delta) <= total.epsilon
        low, high = basic_eps, total.epsilon
        for _ in range(100):  # bisection: largest per-release eps that still fits
            mid = 0.5 * (low + high)
            low, high = (mid, high) if fits(mid) else (low, mid)
        return Budget(low, per_delta)
    raise ValueError(
        f"split_budget supports 'basic' and 'advanced'; for {composition!r} calibrate the "
        "mechanism with calibrate_noise_multiplier"
    )


def calibrate_noise_multiplier(
    total: Budget,
    releases: int,
    kind: Literal["gaussian", "laplace"],
    composition: Composition = "pld",
) -> float:
    """Smallest noise multiplier (noise std or scale / sensitivity) such that ``releases``
    releases of a Gaussian or Laplace mechanism compose to at most ``total`` (PLD or RDP).

    Gaussian under PLD is closed-form: k Gaussian releases of multiplier m compose exactly to
    one of multiplier m / sqrt(k), so m = sqrt(k) * analytic_sigma(eps, delta). Everything else
    is dp-accounting's ``calibrate_dp_mechanism`` bisection from a safe lower endpoint.
    """
    check_epsilon(total.epsilon, "total epsilon")
    check_delta(total.delta, "total delta")
    k = check_count(releases, "releases")
    if composition not in ("pld", "rdp"):
        raise ValueError("calibrate_noise_multiplier needs composition 'pld' or 'rdp'")
    if kind == "gaussian":
        exact = math.sqrt(k) * float(get_sigma_gaussian(total.epsilon, total.delta))
        if composition == "pld":
            return exact
        lower, event_cls = exact, dp_event.GaussianDpEvent  # RDP is never tighter than exact
    else:
        lower, event_cls = 0.5 / total.epsilon, dp_event.LaplaceDpEvent
    return float(
        mechanism_calibration.calibrate_dp_mechanism(
            lambda: _make_accountant(composition),
            lambda m: dp_event.SelfComposedDpEvent(event_cls(m), k),
            total.epsilon,
            total.delta,
            mechanism_calibration.LowerEndpointAndGuess(lower, 2.0 * lower),
            tol=1e-6 * lower,
        )
    )
