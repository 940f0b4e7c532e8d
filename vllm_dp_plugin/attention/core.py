"""``DPCrossAttention``: build once from a private context's K/V, answer any number of queries.

Privacy contract: ``add``/``build`` are the only methods that see exact K/V; they keep
mapped features only until ``finalize``, which draws the noise once (from the caller's
generator: keyed noise in serving) and drops everything exact. Every answer afterwards is
post-processing of the release, so repeated and adaptive queries spend nothing.

How the release is built and read is the mode's (``params.mode``, looked up once in the
``modes.RELEASE_MODES`` registry: ``state``, ``tree``, ``reference``); this class does the rest
the same way for every mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..privacy.keyed_noise import fresh_generator
from ..privacy.mechanisms import Mechanism
from .accounting import AttentionAccount, StateSensitivity, head_budget
from .base import HeadGenerators, QueryPath, Release, ReleaseBuilder
from .budget import TreeBudget
from .budget import tree_budget as budget_cascade
from .features import FeatureMap, RandomFeatures, TaylorFeatures, taylor_degree, taylor_kernel_error
from .mapping import HeadMapping, assert_same_heads
from .merge import AttentionPart, private_part
from .modes import release_mode
from .params import DPAttentionParams
from .tree import TreeRelease
from .tree_spec import TreeSpec, make_tree_spec


@dataclass
class PrivateAnswer:
    """``num: [H_q, m, d_v]``, ``den: [H_q, m]``; the true sums are ``exp(log_scale) (num, den)``."""

    num: torch.Tensor
    den: torch.Tensor
    log_scale: torch.Tensor

    def output(self) -> torch.Tensor:
        return self.num / self.den[..., None]

    def part(self) -> AttentionPart:
        """As a mergeable softmax part (``merge.merge_parts``)."""
        return private_part(self.num, self.den, self.log_scale)


def make_feature_map(params: DPAttentionParams, mapping: HeadMapping, head_dim: int) -> FeatureMap:
    """The public feature map: PRF, or Taylor of ``params.degree`` / the smallest degree whose
    remainder meets ``params.kernel_error`` at the public logit bound (``taylor_degree``)."""
    if params.features == "prf":
        return RandomFeatures(head_dim, params.num_random_features, mapping.beta, params.feature_seed)
    logit_bound = mapping.logit_bound(head_dim)
    degree = params.degree
    if degree is None:
        degree = taylor_degree(logit_bound, params.kernel_error, mapping.signed)
    r = math.comb(head_dim + degree, degree)
    if r > params.max_features:
        raise ValueError(
            f"Taylor degree {degree} on head_dim {head_dim} needs r={r:.3g} features "
            f"(> max_features={params.max_features}) at logit bound T={logit_bound:.3g}; tighten "
            "the public key/query bounds, set a lower `degree` (kernel error is reported), or "
            "use features='prf'"
        )
    return TaylorFeatures(head_dim, degree, mapping.beta)


class DPCrossAttention:
    """DP attention of all heads of one layer over one private context.

    Shapes: ``K: [H_kv, n, d]``, ``V: [H_kv, n, d_v]``, ``Q: [H_q, m, d]`` with ``H_q = G H_kv``;
    query head ``h`` reads KV head ``h // G`` (GQA: one release per KV head, the G query heads
    of its group folded into its query batch).
    """

    def __init__(
        self,
        params: DPAttentionParams,
        mapping: HeadMapping,
        num_kv_heads: int,
        head_dim: int,
        value_dim: int,
        num_query_heads: int | None = None,
        budget_heads: int | None = None,
    ):
        self.params, self.mapping = params, mapping
        # KV-head releases that share params' budget when scope="layer" (default: this layer's);
        # serving passes layers x KV heads so the budget covers the whole model.
        self.budget_heads = budget_heads or num_kv_heads
        self.kv_heads, self.head_dim, self.value_dim = num_kv_heads, head_dim, value_dim
        self.query_heads = num_query_heads or num_kv_heads
        if self.query_heads % num_kv_heads:
            raise ValueError(f"{self.query_heads} query heads do not fold onto {num_kv_heads} KV heads")
        if mapping.key_center is not None and tuple(mapping.key_center.shape) != (num_kv_heads, head_dim):
            raise ValueError(f"key_center must be [{num_kv_heads}, {head_dim}]")
        self.features = make_feature_map(params, mapping, head_dim)
        self.logit_bound = mapping.logit_bound(head_dim)
        self.mode = release_mode(params.mode)
        self._builder: ReleaseBuilder | None = None  # the exact rows: created on K/V's device
        self.rows = 0
        self._release: Release | None = None
        self._query_path: QueryPath | None = None  # (query features, release re-indexed for them)
        self._account: AttentionAccount | None = None

    # ------------------------------------------------------------------ build
    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Feed one chunk of the private context (``k: [H_kv, n_c, d]``, ``v: [H_kv, n_c, d_v]``)."""
        if self._release is not None:
            raise RuntimeError("the release is final: build a new DPCrossAttention for a new context")
        assert_same_heads("K", k, self.kv_heads, self.head_dim)
        assert_same_heads("V", v, self.kv_heads, self.value_dim)
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"K and V disagree on context length: {k.shape[1]} vs {v.shape[1]}")
        if self.rows + k.shape[1] > self.params.max_context:
            raise ValueError(
                f"private context of {self.rows + k.shape[1]} tokens exceeds max_context={self.params.max_context}"
            )
        pk = self.features(self.mapping.keys(k))  # [H, n_c, F]
        values = self.mapping.values(v)
        weights = torch.cat([values, torch.ones_like(values[..., :1])], dim=-1)  # [H, n_c, W]
        if self._builder is None:
            self._builder = self.mode.builder(self, pk.device)
        self._builder.add(pk, weights)
        self.rows += k.shape[1]

    def finalize(self, generator: HeadGenerators | None = None) -> DPCrossAttention:
        """Draw the noise once and drop every exact quantity. ``generator``: one for all KV
        heads, or one per KV head (serving keys each by its global head, so every
        tensor-parallel split releases the same noise); defaults to a fresh secret seed."""
        if self.rows == 0:
            raise ValueError("the private context is empty: call add(K, V) first")
        generator = generator or fresh_generator()
        if not isinstance(generator, torch.Generator) and len(generator) != self.kv_heads:
            raise ValueError(f"{len(generator)} generators for {self.kv_heads} KV heads")
        mechanism = self.planned_mechanism(self.rows)
        self._release = self._builder.release(mechanism, generator)  # a refusal keeps the rows
        self._builder = None
        self._query_path = self.mode.query_path(self, self._release)
        self._account = AttentionAccount(mechanism, self.kv_heads, self.params.composition)
        return self

    def build(self, k: torch.Tensor, v: torch.Tensor, generator: HeadGenerators | None = None) -> DPCrossAttention:
        """``add(k, v)`` then ``finalize(generator)``."""
        self.add(k, v)
        return self.finalize(generator)

    def planned_mechanism(self, n: int) -> Mechanism:
        """The per-KV-head release a context of ``n`` rows gets (public: bounds, params, n)."""
        return self.mode.mechanism(self, n)

    def state_sensitivity(self) -> StateSensitivity:
        """Replace-one sensitivities of the state from the public bounds (``StateSensitivity``)."""
        keys = self.mapping.key_bounds(self.head_dim)
        gamma = self.features.coordinate_bounds(keys)
        r_w, dv = self.mapping.value_bound, self.value_dim
        return StateSensitivity(
            l2=2.0 * self.features.norm_bound(keys) * math.sqrt(dv * r_w**2 + 1.0),
            l1=2.0 * float(gamma.sum()) * (dv * r_w + 1.0),
            linf=2.0 * float(gamma.max()) * max(r_w, 1.0),
            dim=self.features.dim * (dv + 1),
        )

    def tree_spec(self, n: int) -> TreeSpec:
        """The public DPTree configuration for a context of ``n`` rows."""
        budget = self.tree_budget(n)
        return make_tree_spec(
            self.features,
            self.mapping.key_bounds(self.head_dim),
            self.mapping.value_bound,
            self.mapping.signed,
            self.params.tree,
            budget,
            self.value_dim,
            n,
        )

    def tree_budget(self, n: int) -> TreeBudget:
        """The DPTree budget cascade of one KV head for a context of ``n`` rows."""
        head = head_budget(self.params, self.budget_heads)
        return budget_cascade(head, self.params.tree, self.features.dim, self.value_dim, n)

    def tree_table_bytes(self, n: int) -> int:
        """Bytes the tree mode's release (fp32 path-sum table) needs for ``n`` rows."""
        return TreeRelease.planned_nbytes(self.tree_spec(n), self.kv_heads)

    # ------------------------------------------------------------------ query
    def query_parts(self, q: torch.Tensor) -> PrivateAnswer:
        """DP numerators/denominators for ``q: [H_q, m, d]`` (post-processing of the release)."""
        if self._release is None:
            raise RuntimeError("call build(K, V) or add(...) + finalize() before querying")
        assert_same_heads("Q", q, self.query_heads, self.head_dim)
        groups, m = self.query_heads // self.kv_heads, q.shape[1]
        dtype = self.mode.query_dtype(self)
        mapped = self.mapping.queries(q, dtype)  # [H_q, m, d]
        kv_head = torch.arange(self.query_heads) // groups
        features, release = self._query_path or (self.features, self._release)
        pq = features(mapped, dtype).reshape(self.kv_heads, groups * m, -1)  # [H_kv, G m, F]
        ans = release.answer(pq).to(torch.float64).reshape(self.query_heads, m, self.value_dim + 1)
        num, den = ans[..., :-1], ans[..., -1]
        if self.params.clamp:
            den, num = self._clamped(den, num)
        return PrivateAnswer(num, den, self.mapping.log_scale(mapped, kv_head).to(torch.float64))

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """DP attention output ``[H_q, m, d_v]`` (float64)."""
        return self.query_parts(q).output()

    def _clamped(self, den: torch.Tensor, num: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The denominator is clamped into [n e^{t_min}, n e^{T}], the range every true
        denominator lies in (t_min = 0 in the nonnegative paper setting, else -T); then num so
        that num/den lies in [-R_w, R_w], where every exact output lies. Both are
        post-processing, so free of privacy cost."""
        t_min = -self.logit_bound if self.mapping.signed else 0.0
        den = den.clamp(self.rows * math.exp(t_min), self.rows * math.exp(self.logit_bound))
        limit = self.mapping.value_bound * den[..., None]
        return den, torch.maximum(torch.minimum(num, limit), -limit)

    # ------------------------------------------------------------------ accounting
    def relative_error_bound(self, n: int) -> float:
        """A public bound on the relative error of a DP denominator for a context of ``n`` rows:
        the guaranteed kernel error (``inf`` for random features: no uniform guarantee) plus the
        noise's standard deviation at the largest query feature norm over the smallest true
        denominator ``n e^{t_min}``. Reads the bounds, the parameters and ``n`` only (the gate).
        For ``tree`` the noise is one node's, a lower bound on an answer's."""
        kernel = self.kernel_error
        sigma = math.sqrt(self.planned_mechanism(n).variance)
        t_min = -self.logit_bound if self.mapping.signed else 0.0
        query_norm = self.features.norm_bound(self.mapping.query_bounds(self.head_dim))
        log_noise = math.log(sigma) + math.log(query_norm) - math.log(n) - t_min if sigma > 0 else -math.inf
        noise = math.exp(log_noise) if log_noise < 700 else math.inf
        return (math.inf if math.isnan(kernel) else kernel) + noise

    @property
    def kernel_error(self) -> float:
        """Guaranteed relative kernel error eps_s of the Taylor map at the public logit bound
        (Lemma G.5); ``nan`` for random features (no uniform guarantee)."""
        if not isinstance(self.features, TaylorFeatures):
            return math.nan
        return taylor_kernel_error(self.logit_bound, self.features.degree, self.mapping.signed)

    @property
    def account(self) -> AttentionAccount:
        if self._account is None:
            raise RuntimeError("nothing is released yet: the account exists after finalize()")
        return self._account

    @property
    def release_nbytes(self) -> int:
        return self._release.nbytes if self._release is not None else 0
