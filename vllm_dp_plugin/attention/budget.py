"""The DPTree budget cascade (the paper's splits, composed to per-node noise) and what it
actually spends.

One KV head's DP cross-attention (Alg. 1) splits its (eps, delta, delta') as

    Alg. 1   A weight columns (A = d_v + 1 row-level, or 2 entry-level)   basic
    Alg. 7   l copies                                                      basic
    Alg. 3   r feature DPTreeDistances (c eps/(3 sqrt(r ln(2/delta'))))    advanced, slack delta'/2
             + one s_w DPTreeDistance (eps/3, delta/3)                     basic
    Alg. 4   3 moment trees                                                basic
    Alg. 2   L nodes on a root-leaf path                                   basic

``tree_budget`` walks it top-down to per-node (eps, delta); ``TreeBudget.spent`` composes the
per-node values back up with the same theorems (dp-accounting's advanced composition where the
paper uses Thm A.10), so the reported total is what the noise really spends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..privacy.accountant import Budget, advanced_epsilon
from ..privacy.validation import check_count, check_delta, check_epsilon, check_positive

PAPER_C = 0.09
CHERNOFF_COPIES = 8.25  # Chernoff, per-copy success 0.99, median right iff > l/2 succeed


@dataclass(frozen=True)
class TreeParams:
    """Knobs of the DPTree mechanism where the paper leaves a choice. ``TreeParams.paper()`` is
    paper-literal.

    ``delta_prime``: advanced-composition slack delta' (per head, added to delta).
    ``copies``: l independent copies answered by their median (odd; 1 is practical: the bounded
      TLap noise already bounds the error of every query at once, deterministically).
    ``c``: Alg. 3's composition constant; ``"tight"`` solves advanced composition for the
      largest per-feature epsilon that still fits eps/3 (c ~ 0.7; the paper's c < 0.1 spends
      only ~0.047 eps of that eps/3).
    ``output_level``: ``row`` (A = d_v + 1, Remark 4.2) or ``entry`` (A = 2, Thm 4.1).
    ``ranges``: ``coordinate`` (public per-feature Gamma_alpha) or ``global`` (Gamma_{R,s}).
    ``ones_sensitivity``: ``unit`` (R_w = 1, the true bound of the all-ones column) or ``paper``
      (R_w).
    ``sw_range``: ``unit`` (s_w tree over [0, 1], its data being identically 1) or ``paper``
      (over [0, R]).
    """

    delta_prime: float = 1e-6
    copies: int = 1
    c: float | Literal["tight"] = "tight"
    output_level: Literal["row", "entry"] = "row"
    ranges: Literal["coordinate", "global"] = "coordinate"
    ones_sensitivity: Literal["unit", "paper"] = "unit"
    sw_range: Literal["unit", "paper"] = "unit"

    def __post_init__(self) -> None:
        check_delta(self.delta_prime, "delta_prime")
        check_count(self.copies, "copies")
        if self.copies % 2 == 0:
            raise ValueError(f"copies must be odd (the answer is the median of the copies), got {self.copies}")
        if self.c != "tight" and not (0 < float(self.c) < 1):
            raise ValueError(f"c must lie in (0, 1) or be 'tight', got {self.c!r}")
        _check_choice("output_level", self.output_level, ("row", "entry"))
        _check_choice("ranges", self.ranges, ("coordinate", "global"))
        _check_choice("ones_sensitivity", self.ones_sensitivity, ("unit", "paper"))
        _check_choice("sw_range", self.sw_range, ("unit", "paper"))

    @staticmethod
    def paper(copies: int = 1, delta_prime: float = 1e-6) -> TreeParams:
        """Paper-literal constants: c = 0.09, global Gamma, R_w for every column, s_w over [0, R],
        (The paper's own l is ``theory_copies``; l = 1 keeps memory finite.)"""
        return TreeParams(
            delta_prime=delta_prime,
            copies=copies,
            c=PAPER_C,
            ranges="global",
            ones_sensitivity="paper",
            sw_range="paper",
        )


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def num_leaves(n: int) -> int:
    """N = 2^ceil(log2 max(n, 2)) leaves (the paper takes N = n, implicitly a power of 2)."""
    check_count(n, "context length n")
    return 1 << math.ceil(math.log2(max(n, 2)))


def theory_copies(
    net_dim: int, input_dim: int, bound: float, kernel_error: float, failure: float = 0.01
) -> int:
    """l = ceil(8.25 (k ln(5R/eps0) + ln(1/p_f))), odd, eps0 = eps_s/(sqrt(d) R): the paper's
    l = O(r log(dR/(eps_s p_f))) with its constant made explicit (an eps0-net of (5R/eps0)^k
    points, Chernoff with per-copy success 0.99 and a median right iff > l/2 copies succeed).

    ``net_dim`` is k = r (paper, Lemma G.9) or d (Fact F.3); ``input_dim`` is d."""
    check_count(net_dim, "net_dim")
    eps0 = kernel_error / (math.sqrt(check_count(input_dim, "input_dim")) * bound)
    copies = math.ceil(CHERNOFF_COPIES * (net_dim * math.log(5 * bound / eps0) + math.log(1 / failure)))
    return copies + (copies % 2 == 0)


def feature_epsilon(copy_eps: float, copy_delta_prime: float, features: int, c: float) -> float:
    """Alg. 3 line 15: eps_f = c eps / (3 sqrt(r ln(2/delta'))) (the paper prints "ce")."""
    return c * copy_eps / (3.0 * math.sqrt(features * math.log(2.0 / copy_delta_prime)))


def tight_c(copy_eps: float, copy_delta: float, copy_delta_prime: float, features: int) -> float:
    """The largest c whose r feature structures compose to <= eps/3 (about 0.7, where the paper
    takes c < 0.1), by bisection on dp-accounting's advanced composition (never looser than
    Thm A.10)."""
    delta_f = copy_delta / (3 * features)
    total_delta = features * delta_f + copy_delta_prime / 2
    fits = lambda c: advanced_epsilon(
        feature_epsilon(copy_eps, copy_delta_prime, features, c), delta_f, features, total_delta
    ) <= copy_eps / 3
    low, high = 0.0, 3.0 * math.sqrt(features * math.log(2.0 / copy_delta_prime))  # eps_f = eps/3
    for _ in range(80):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


@dataclass(frozen=True)
class TreeBudget:
    """Per-level budgets of one KV head's DPTree cross-attention.

    ``columns`` A, ``copies`` l, ``features`` r, ``levels`` L; ``head`` is the (eps, delta) the
    head was given and ``delta_prime`` its slack; ``c`` the resolved constant.
    ``feature_node`` / ``sw_node``: TLap (eps, delta) of one node of a feature / s_w tree.
    """

    head: Budget
    delta_prime: float
    columns: int
    copies: int
    features: int
    levels: int
    c: float
    feature_node: Budget
    sw_node: Budget

    def spent(self) -> Budget:
        """(eps, delta + delta') the head really spends, composed up from the node budgets."""
        feature_tree = _basic(self.feature_node, self.levels)
        feature_distance = _basic(feature_tree, 3)
        copy_delta_prime = self.delta_prime / (self.columns * self.copies)
        features_total_delta = self.features * feature_distance.delta + copy_delta_prime / 2
        features = Budget(
            advanced_epsilon(
                feature_distance.epsilon, feature_distance.delta, self.features, features_total_delta
            ),
            features_total_delta,
        )
        sw_distance = _basic(_basic(self.sw_node, self.levels), 3)  # charged as the paper does
        copy = Budget(features.epsilon + sw_distance.epsilon, features.delta + sw_distance.delta)
        return _basic(copy, self.copies * self.columns)

    def report(self) -> str:
        spent = self.spent()
        return (
            f"DPTree head: A={self.columns} columns x l={self.copies} copies x r={self.features} "
            f"features x 3 moments x L={self.levels} levels, c={self.c:.4g}; node TLap "
            f"eps={self.feature_node.epsilon:.4g}, delta={self.feature_node.delta:.3g}; "
            f"spends {spent} (given {self.head}, delta'={self.delta_prime:.3g})"
        )


def _basic(budget: Budget, k: int) -> Budget:
    return Budget(budget.epsilon * k, budget.delta * k)


def tree_budget(head: Budget, params: TreeParams, features: int, value_dim: int, n: int) -> TreeBudget:
    """Top-down split of one head's (eps, delta) (+ params.delta_prime) to per-node TLap budgets.

    Raises if a node's delta would reach 1/2 (TLap needs B >= Delta)."""
    check_epsilon(head.epsilon)
    check_delta(head.delta)
    check_count(features, "features")
    check_count(value_dim, "value_dim")
    columns = value_dim + 1 if params.output_level == "row" else 2
    levels = int(math.log2(num_leaves(n)))
    parts = columns * params.copies
    copy_eps, copy_delta = head.epsilon / parts, head.delta / parts
    copy_delta_prime = params.delta_prime / parts
    c = tight_c(copy_eps, copy_delta, copy_delta_prime, features) if params.c == "tight" else float(params.c)
    eps_f = feature_epsilon(copy_eps, copy_delta_prime, features, c)
    delta_f = copy_delta / (3 * features)
    feature_node = Budget(eps_f / (3 * levels), delta_f / (3 * levels))
    sw_node = Budget(copy_eps / (9 * levels), copy_delta / (9 * levels))
    for name, node in (("feature", feature_node), ("s_w", sw_node)):
        check_positive(node.epsilon, f"{name} node epsilon")
        if node.delta >= 0.5:
            raise ValueError(f"{name} node delta {node.delta} >= 1/2: truncated Laplace needs < 1/2")
    return TreeBudget(head, params.delta_prime, columns, params.copies, features, levels, c, feature_node, sw_node)
