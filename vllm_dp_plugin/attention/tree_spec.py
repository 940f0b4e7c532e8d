"""Everything public that fixes one KV head's DPTree mechanism, shared by ``reference`` and ``tree``.

Canonical noise layout (both modes consume exactly these tensors when noise is injected):
* ``feature_noise: [H, W, C, F, 3, 2N]`` float64: node noise of the tree for (head, weight
  column, copy, feature, moment q); heap-indexed nodes 1..2N-1 at positions 1..2N-1 (node 1 is
  the root: never read, never released; position 0 unused).
* ``sw_noise: [H, W, C, 2N]`` float64: the s_w tree's moment-2 nodes (its q = 0, 1 trees are
  never read, since s_w is queried only at 0 where their y^{2-q} factors vanish, so skipping
  them leaves the output distribution unchanged).
W = d_v + 1 columns; column ``d_v`` is the all-ones weight (the softmax denominator, Alg. 1 D_0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..privacy.accountant import Budget
from ..privacy.mechanisms import truncated_laplace_mechanism
from ..privacy.noise import LaplaceNoise
from .budget import TreeBudget, TreeParams, num_leaves
from .features import FeatureMap, InputBounds, TaylorFeatures


@dataclass(frozen=True)
class TreeSpec:
    """``lo, hi: [F]`` bin range of each feature tree; ``sensitivity: [W, F, 3]`` = Delta_q =
    2 R_w' Gamma_f^q; ``sw_hi`` / ``sw_sensitivity: [W]`` for the s_w tree over [0, sw_hi];
    ``leaves`` N; ``copies`` C; per-node budgets from the cascade."""

    lo: torch.Tensor
    hi: torch.Tensor
    sensitivity: torch.Tensor
    sw_hi: float
    sw_sensitivity: torch.Tensor
    leaves: int
    copies: int
    feature_node: Budget
    sw_node: Budget

    @property
    def levels(self) -> int:
        return self.leaves.bit_length() - 1

    def feature_noise_scale(self) -> tuple[torch.Tensor, float]:
        """(scale [W, F, 3], bound/scale ratio) of the TLap law of every feature-tree node."""
        return _tlap(self.sensitivity, self.feature_node)

    def sw_noise_scale(self) -> tuple[torch.Tensor, float]:
        """(scale [W], bound/scale ratio) of the s_w tree's nodes."""
        return _tlap(self.sw_sensitivity, self.sw_node)


def _tlap(sensitivity: torch.Tensor, node: Budget) -> tuple[torch.Tensor, float]:
    unit = truncated_laplace_mechanism(1.0, node.epsilon, node.delta).noise
    return sensitivity * unit.scale, unit.bound / unit.scale


def make_tree_spec(
    features: FeatureMap,
    keys: InputBounds,
    value_bound: float,
    signed: bool,
    params: TreeParams,
    budget: TreeBudget,
    value_dim: int,
    n: int,
) -> TreeSpec:
    """Ranges and sensitivities from public bounds only: feature f's range is [0, Gamma_f]
    ([-Gamma_f, Gamma_f] for signed inputs), moment q of a weight column with bound R_w has
    sensitivity 2 R_w Gamma_f^q (R_w = 1 for the ones column under ``ones_sensitivity="unit"``),
    and the s_w tree, whose data are identically 1, ranges over [0, 1] (``sw_range="unit"``) or
    the paper's [0, R]."""
    if params.ranges == "global":
        if not isinstance(features, TaylorFeatures):
            raise ValueError("ranges='global' (Gamma_{R,s}) is defined for Taylor features only")
        gamma = torch.full((features.dim,), features.paper_global_bound(keys.coord), dtype=torch.float64)
    else:
        gamma = features.coordinate_bounds(keys).to(torch.float64)
    lo = -gamma if signed else torch.zeros_like(gamma)
    weight_bound = torch.full((value_dim + 1,), float(value_bound), dtype=torch.float64)
    if params.ones_sensitivity == "unit":
        weight_bound[-1] = 1.0
    moments = torch.arange(3, dtype=torch.float64)
    sensitivity = 2.0 * weight_bound[:, None, None] * gamma[None, :, None] ** moments  # [W, F, 3]
    sw_hi = 1.0 if params.sw_range == "unit" else keys.coord
    return TreeSpec(
        lo=lo,
        hi=gamma,
        sensitivity=sensitivity,
        sw_hi=sw_hi,
        sw_sensitivity=2.0 * weight_bound * sw_hi**2,
        leaves=num_leaves(n),
        copies=params.copies,
        feature_node=budget.feature_node,
        sw_node=budget.sw_node,
    )


def sample_tree_noise(
    spec: TreeSpec, heads: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh node noise in the canonical layout (small sizes: tests and the reference mode).

    Returns ``feature_noise [H, W, C, F, 3, 2N]`` and ``sw_noise [H, W, C, 2N]``; the root and
    position 0 are zero."""
    W, F = spec.sensitivity.shape[:2]
    N, C = spec.leaves, spec.copies
    scale, ratio = spec.feature_noise_scale()
    feature = LaplaceNoise(1.0, ratio).sample((heads, W, C, F, 3, 2 * N), generator)
    feature *= scale.to(feature)[None, :, None, :, :, None]
    sw_scale, sw_ratio = spec.sw_noise_scale()
    sw = LaplaceNoise(1.0, sw_ratio).sample((heads, W, C, 2 * N), generator)
    sw *= sw_scale.to(sw)[None, :, None, None]
    feature[..., :2] = 0.0
    sw[..., :2] = 0.0
    return feature, sw
