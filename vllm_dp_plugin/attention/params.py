"""One parameter object for every DP attention mode: all modes share its knobs and budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..privacy.accountant import COMPOSITIONS, Budget
from ..privacy.validation import check_count, check_delta, check_epsilon, check_positive
from .budget import TreeParams

MODES: tuple[str, ...] = ("reference", "tree", "state")
FEATURES: tuple[str, ...] = ("taylor", "prf")
STATE_MECHANISMS: tuple[str, ...] = ("gaussian", "truncated_laplace")

Mode = Literal["reference", "tree", "state"]


@dataclass(frozen=True)
class DPAttentionParams:
    """What one layer's DP attention over a private context releases and spends.

    ``epsilon``/``delta`` cover one KV head (``scope="head"``) or all KV heads of the layer
    together (``scope="layer"``, split by ``composition``). The privacy unit is one (k_j, v_j)
    row of the layer's private context, replace-one neighbours (n is public and unchanged).

    ``mode``: ``state`` releases the noisy kernelised state ``P(K)^T [V | 1]`` once (for the
    softmax kernel the DPTree's answers reduce to this linear-attention state plus tree noise, so
    releasing it directly is far more accurate; not in the paper); ``tree`` the vectorised DPTree
    (same output distribution as the literal oracle); ``reference`` Alg. 1-7 literally (oracle).
    ``features``: ``taylor`` (degree ``degree`` or the smallest meeting ``kernel_error``) or
    ``prf`` (``num_random_features`` from public ``feature_seed``).
    ``mechanism``: the state's noise, Gaussian (l2 sensitivity) or truncated Laplace (corrected
    TrLaplace calibration of the l1/linf sensitivities; the TrLaplace paper's Thm 3 calibration
    is not DP for d > 1); rdp composition takes the Gaussian only.
    ``clamp``: post-process each denominator into ``[n e^{-T}, n e^{T}]`` and outputs into
    ``[-R_w, R_w]``, the ranges the exact values lie in (post-processing, free of privacy cost);
    off is paper-literal (Alg. 1 divides blindly).
    ``query_dtype``: precision of the state mode's query-side features and contraction (the
    release itself is always sampled and stored in float64; tree/reference query in float64
    because P_wx and Value are large and nearly cancel).
    ``max_context``: longest private context accepted; ``memory_limit_bytes`` caps the tree table.

    Serving builds these from ``config.AttentionPrivacyConfig`` (``plan.attention_params``,
    the one translation): every field both have carries the same name and default there.
    """

    epsilon: float
    delta: float
    mode: Mode = "state"
    scope: Literal["head", "layer"] = "head"
    composition: Literal["basic", "advanced", "pld", "rdp"] = "pld"
    features: Literal["taylor", "prf"] = "taylor"
    degree: int | None = None
    kernel_error: float = 0.01
    max_features: int = 20_000
    num_random_features: int = 256
    feature_seed: int = 0
    mechanism: Literal["gaussian", "truncated_laplace"] = "gaussian"
    clamp: bool = True
    query_dtype: Literal["float32", "float64"] = "float32"
    tree: TreeParams = field(default_factory=TreeParams)
    max_context: int = 32_768
    memory_limit_bytes: int = 16 << 30

    def __post_init__(self) -> None:
        check_epsilon(self.epsilon)
        check_delta(self.delta)
        _choice("mode", self.mode, MODES)
        _choice("scope", self.scope, ("head", "layer"))
        _choice("composition", self.composition, COMPOSITIONS)
        _choice("features", self.features, FEATURES)
        _choice("mechanism", self.mechanism, STATE_MECHANISMS)
        _choice("query_dtype", self.query_dtype, ("float32", "float64"))
        if self.degree is not None and (not isinstance(self.degree, int) or self.degree < 0):
            raise ValueError(f"degree must be an integer >= 0 or None, got {self.degree!r}")
        check_positive(self.kernel_error, "kernel_error")
        check_count(self.max_features, "max_features")
        check_count(self.num_random_features, "num_random_features")
        check_count(self.max_context, "max_context")
        check_count(self.memory_limit_bytes, "memory_limit_bytes")
        if self.composition == "rdp" and self.mechanism == "truncated_laplace":
            raise ValueError("rdp accounting supports the Gaussian state only; use pld or advanced")

    @staticmethod
    def paper(epsilon: float, delta: float, mode: Mode = "tree", copies: int = 1) -> DPAttentionParams:
        """Paper-literal DPTree (label: "paper"): c = 0.09, global Gamma_{R,s}, R_w for every
        column, s_w over [0, R], no clamps; pair with ``HeadMapping.paper(d)``. The paper's own
        copy count is ``budget.theory_copies`` (~1e5: infeasible beyond toy sizes)."""
        return DPAttentionParams(
            epsilon, delta, mode=mode, clamp=False, tree=TreeParams.paper(copies=copies)
        )

    @property
    def total(self) -> Budget:
        return Budget(self.epsilon, self.delta)


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; use one of {choices}")
