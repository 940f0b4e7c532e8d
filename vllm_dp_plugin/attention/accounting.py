"""What one DP attention layer spends: per KV head, per layer (H heads) and per model (H x L).

The per-head release is a ``Mechanism`` (the Gaussian or truncated-Laplace state, or the
DPTree cascade as one (eps, delta) release); layers and models compose it with the privacy
ledger (dp-accounting underneath), so every figure is what the sampled noise really spends.
"""

from __future__ import annotations

from dataclasses import dataclass

from dp_accounting import dp_event

from ..privacy.accountant import Budget, PrivacyLedger, split_budget
from ..privacy.budget import plan_releases
from ..privacy.events import EpsilonDeltaDpEvent
from ..privacy.mechanisms import Mechanism, gaussian_mechanism, truncated_laplace_mechanism
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
    """Replace-one sensitivity of ``P(K)^T [V | 1]`` (spec 9 D5): ``l2 = 2 sup||P(k)||_2
    sqrt(d_v R_w^2 + 1)``; ``l1 = 2 sum_f Gamma_f (d_v R_w + 1)``; ``linf = 2 max_f Gamma_f max(R_w, 1)``."""

    l2: float
    l1: float
    linf: float
    dim: int


def state_mechanism(params: DPAttentionParams, heads: int, sens: StateSensitivity) -> Mechanism:
    """The per-head noise of the kernelised state release."""
    if params.state_mechanism == "gaussian":
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


@dataclass(frozen=True)
class AttentionAccount:
    """``per_head`` release composed over ``heads`` KV heads per layer and ``layers`` layers."""

    per_head: Mechanism
    heads: int
    composition: str

    def spent(self, layers: int = 1) -> Budget:
        """Total (eps, delta) of ``layers`` layers (1 = one layer). Gaussian releases under
        pld/rdp report eps at the summed delta; (eps, delta) releases at twice it (PLD of
        truncated releases needs room above k delta)."""
        return self._ledger(self.heads * layers).spent()

    def _ledger(self, count: int) -> PrivacyLedger:
        gaussian = isinstance(self.per_head.dp_event, dp_event.GaussianDpEvent)
        slack = 1.0 if gaussian or self.composition == "basic" else 2.0
        target = min(slack * count * self.per_head.delta, 0.5)
        ledger = PrivacyLedger(self.composition, target_delta=target)
        ledger.record(self.per_head, count, "kv head")
        return ledger

    def report(self, layers: int | None = None) -> str:
        lines = [f"per KV head: {self.per_head.statement()}"]
        lines.append(f"per layer ({self.heads} KV heads, {self.composition}): {self.spent(1)}")
        if layers:
            lines.append(f"whole model ({layers} layers x {self.heads} heads): {self.spent(layers)}")
        return "\n".join(lines)
