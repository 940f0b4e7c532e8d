"""What one DP attention layer spends: per KV head, per layer (H heads) and per model (H x L).

The per-head release is a ``Mechanism`` (the Gaussian or truncated-Laplace state, or the
DPTree cascade as one (eps, delta) release); layers and models compose it with the privacy
ledger (dp-accounting underneath), so every figure is what the sampled noise really spends.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dp_accounting import dp_event

from ..privacy.accountant import Budget, PrivacyLedger, advanced_epsilon, split_budget
from ..privacy.budget import plan_releases
from ..privacy.events import EpsilonDeltaDpEvent
from ..privacy.mechanisms import (
    Mechanism,
    gaussian_from_noise_multiplier,
    gaussian_mechanism,
    truncated_laplace_mechanism,
)
from ..privacy.trlaplace import trlaplace_mechanism
from .budget import TreeBudget
from .params import DPAttentionParams


def head_budget(params: DPAttentionParams, heads: int) -> Budget:
    """The (eps, delta) one KV head may spend: the layer total split by basic or advanced
    composition when ``scope="layer"`` (Gaussian under pld/rdp is calibrated jointly instead)."""
    if params.scope == "head":
        return params.total
    return split_budget(params.total, heads, "basic" if params.composition == "basic" else "advanced")


@dataclass(frozen=True)
class StateSensitivity:
    """Replace-one sensitivity of ``P(K)^T [V | 1]`` (one row's term ``P(k) [v | 1]^T`` swapped
    for another): ``l2 = 2 sup||P(k)||_2 sqrt(d_v R_w^2 + 1)``;
    ``l1 = 2 sum_f Gamma_f (d_v R_w + 1)``; ``linf = 2 max_f Gamma_f max(R_w, 1)``."""

    l2: float
    l1: float
    linf: float
    dim: int


def state_mechanism(params: DPAttentionParams, heads: int, sens: StateSensitivity) -> Mechanism:
    """The per-head noise of the kernelised state release."""
    if params.mechanism == "gaussian":
        if params.scope == "layer" and params.composition in ("pld", "rdp"):
            ledger = plan_releases(params.total, heads, "gaussian", params.composition, sens.l2, "state")
            return ledger.releases[0].mechanism
        head = head_budget(params, heads)
        return gaussian_mechanism(sens.l2, head.epsilon, head.delta)
    head = head_budget(params, heads)
    return trlaplace_mechanism(
        head.epsilon,
        sens.dim,
        sens.l2,
        "corrected",
        head.delta,
        sensitivity_l1=sens.l1,
        sensitivity_linf=sens.linf,
    )


def tree_mechanism(budget: TreeBudget, node_sensitivity: float) -> Mechanism:
    """The DPTree cascade of one head as one (eps, delta + delta') release (for ledgers); its
    ``noise`` is the law of one moment-0 feature-tree node (for the report's noise scale)."""
    spent = budget.spent()
    node = budget.feature_node
    return Mechanism(
        name=f"dptree(l={budget.copies}, r={budget.features}, L={budget.levels})",
        epsilon=spent.epsilon,
        delta=spent.delta,
        sensitivity=node_sensitivity,
        sensitivity_norm="l1",
        noise=truncated_laplace_mechanism(node_sensitivity, node.epsilon, node.delta).noise,
        dp_event=EpsilonDeltaDpEvent(spent.epsilon, spent.delta),
    )


def group_mechanism(mechanism: Mechanism, rows: int) -> Mechanism:
    """``mechanism``'s release stated for a group of ``rows`` rows (one document's rows, when a
    document moves only its own rows): the group's sensitivity is ``rows`` times a row's
    (triangle inequality). Gaussian: exact (noise multiplier / rows, its analytic epsilon at
    the same delta); any other (eps, delta) release: group privacy, (rows eps,
    rows e^{(rows - 1) eps} delta), no guarantee (eps = inf) once that delta reaches 1."""
    if rows == 1:
        return mechanism
    name = f"{mechanism.name} x {rows} rows"
    if isinstance(mechanism.dp_event, dp_event.GaussianDpEvent):
        multiplier = mechanism.dp_event.noise_multiplier / rows
        return gaussian_from_noise_multiplier(mechanism.sensitivity * rows, multiplier, mechanism.delta, name)
    eps = rows * mechanism.epsilon
    log_delta = math.log(rows) + (rows - 1) * mechanism.epsilon + math.log(mechanism.delta) if mechanism.delta else -math.inf
    if log_delta >= 0:
        eps, delta = math.inf, 1.0
    else:
        delta = math.exp(log_delta)
    return dataclasses.replace(mechanism, name=name, epsilon=eps, delta=delta,
                               sensitivity=mechanism.sensitivity * rows, dp_event=EpsilonDeltaDpEvent(eps, delta))


def composed_ledger(releases: Sequence[tuple[Mechanism, int]], composition: str) -> PrivacyLedger:
    """A ledger of ``count`` releases of each ``(mechanism, count)`` composed with ``composition``,
    reporting epsilon at the delta the plan set aside: the summed delta of Gaussian releases
    calibrated jointly under pld/rdp and of basic composition, twice it otherwise (advanced
    composition and PLD of (eps, delta) releases need slack above k delta; the split gave them
    delta/(2k) each). Identical releases are merged; advanced composition of different releases
    composes the largest (eps, delta) of them (it covers each)."""
    merged: list[tuple[Mechanism, int]] = []
    for mechanism, count in releases:
        same = next((i for i, (m, _) in enumerate(merged) if m.dp_event == mechanism.dp_event), None)
        if same is None:
            merged.append((mechanism, count))
        else:
            merged[same] = (merged[same][0], merged[same][1] + count)
    if composition == "advanced" and len(merged) > 1:
        eps, delta = max(m.epsilon for m, _ in merged), max(m.delta for m, _ in merged)
        widest = dataclasses.replace(merged[0][0], epsilon=eps, delta=delta, dp_event=EpsilonDeltaDpEvent(eps, delta))
        merged = [(widest, sum(c for _, c in merged))]
    gaussian = all(isinstance(m.dp_event, dp_event.GaussianDpEvent) for m, _ in merged)
    joint = composition == "basic" or (gaussian and composition in ("pld", "rdp"))
    target = min((1.0 if joint else 2.0) * sum(m.delta * c for m, c in merged), 0.5)
    ledger = PrivacyLedger(composition, target_delta=target)
    for mechanism, count in merged:
        ledger.record(mechanism, count, "kv head")
    return ledger


def composed_spend(releases: Sequence[tuple[Mechanism, int]], composition: str) -> Budget:
    """The (eps, delta) ``composed_ledger`` reports. Under pld, k identical (eps, delta) releases
    (no finer curve known) report the smaller of two valid bounds at the same delta: the PLD
    accountant's (its discretisation rounds up) and the optimal advanced composition theorem
    (which ``split_budget`` calibrated them with)."""
    ledger = composed_ledger(releases, composition)
    spent = ledger.spent()
    (only, *more) = ledger.releases
    if composition == "pld" and not more and isinstance(only.mechanism.dp_event, EpsilonDeltaDpEvent):
        theorem = advanced_epsilon(only.mechanism.epsilon, only.mechanism.delta, only.count, ledger.target_delta)
        spent = Budget(min(spent.epsilon, theorem), spent.delta)
    return spent


@dataclass(frozen=True)
class AttentionAccount:
    """``per_head`` release composed over ``heads`` KV heads per layer and ``layers`` layers."""

    per_head: Mechanism
    heads: int
    composition: str

    def spent(self, layers: int = 1) -> Budget:
        """Total (eps, delta) of ``layers`` layers (1 = one layer), as ``composed_ledger``
        reports it."""
        return composed_spend([(self.per_head, self.heads * layers)], self.composition)

    def report(self, layers: int | None = None) -> str:
        lines = [f"per KV head: {self.per_head.statement()}"]
        lines.append(f"per layer ({self.heads} KV heads, {self.composition}): {self.spent(1)}")
        if layers:
            lines.append(f"whole model ({layers} layers x {self.heads} heads): {self.spent(layers)}")
        return "\n".join(lines)
