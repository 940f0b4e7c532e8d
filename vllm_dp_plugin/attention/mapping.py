"""Public head mapping: real q, k, v -> the bounded setting of the DP mechanisms.

Every constant here is an *input*: a logit scale, a public mean key, clipping bounds. None is
ever computed from the private context. ``HeadMapping.calibrate`` derives them from public
calibration activations (e.g. other documents run through the same model).

Transforms (all fixed per-row maps, so DP-safe; ``python -m benchmarks.attention`` measures their
distortion as E1 vs E0):
* keys: ``k <- clip_box(k - mu_k, R_k)`` then l2-clip to ``key_norm`` (if given);
* queries: ``q <- clip_box(q, R_q)`` then l2-clip to ``query_norm``;
* values: ``v <- clip_box(v, R_w)``.
Centring shifts every private logit by ``-beta <q, mu_k>``: a query-only term, returned as the
log-scale of the private part so merging with exact public attention stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..privacy.validation import check_positive
from .features import InputBounds


def check_finite(name: str, x: torch.Tensor) -> torch.Tensor:
    """Raise ``ValueError`` naming ``name`` unless every entry of ``x`` is finite."""
    if not torch.is_tensor(x):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    # One reduction first: a NaN or inf entry makes the sum non-finite (the elementwise check
    # only runs when the sum is, e.g. on overflow of huge finite entries).
    if not torch.isfinite(x.sum()) and not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or inf")
    return x


def _clip_norm(x: torch.Tensor, norm: float | None) -> torch.Tensor:
    if norm is None:
        return x
    scale = torch.clamp(norm / x.norm(dim=-1, keepdim=True).clamp_min(1e-300), max=1.0)
    return x * scale


@dataclass(frozen=True)
class HeadMapping:
    """Public preprocessing of one attention layer's heads.

    ``beta``: logit scale (1/sqrt(d_h) for standard heads; 1/d in the paper).
    ``key_bound`` R_k, ``query_bound`` R_q, ``value_bound`` R_w: coordinatewise clips.
    ``key_norm`` / ``query_norm``: optional l2 clips (tighter logit range than the box).
    ``key_center``: ``[H_kv, d]`` public mean key, or None.
    ``signed``: False is the paper-literal setting (K, Q in [0, R]^d; inputs outside are an error).
    """

    beta: float
    key_bound: float
    query_bound: float
    value_bound: float
    key_norm: float | None = None
    query_norm: float | None = None
    key_center: torch.Tensor | None = None
    signed: bool = True

    def __post_init__(self) -> None:
        for name in ("beta", "key_bound", "query_bound", "value_bound"):
            check_positive(getattr(self, name), name)
        for name in ("key_norm", "query_norm"):
            if getattr(self, name) is not None:
                check_positive(getattr(self, name), name)
        if self.key_center is not None:
            check_finite("key_center", self.key_center)
            if not self.signed:
                raise ValueError("key centring produces signed keys; it needs signed=True")

    @staticmethod
    def paper(dim: int, bound: float = 1.0, value_bound: float = 1.0) -> HeadMapping:
        """The paper's setting (Def. 1.1): beta = 1/d, K, Q in [0, R]^d, V in [-R_w, R_w]."""
        return HeadMapping(1.0 / dim, bound, bound, value_bound, signed=False)

    def key_bounds(self, dim: int) -> InputBounds:
        return InputBounds.of(self.key_bound, self.key_norm, dim)

    def query_bounds(self, dim: int) -> InputBounds:
        return InputBounds.of(self.query_bound, self.query_norm, dim)

    def logit_bound(self, dim: int) -> float:
        """T with |beta <q, k>| <= T for all mapped q, k (Cauchy-Schwarz on the l2 bounds)."""
        return self.beta * self.key_bounds(dim).norm * self.query_bounds(dim).norm

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """k: [H, n, d] -> mapped keys, float64."""
        k = check_finite("K", k).to(torch.float64)
        if self.key_center is not None:
            k = k - self.key_center.to(k)[:, None, :]
        return self._box(k, self.key_bound, self.key_norm, "K")

    def queries(self, q: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """q: [H, m, d] -> mapped queries in ``dtype`` (float64 unless the query side of a
        release runs in float32: queries are public, precision is utility only)."""
        return self._box(check_finite("Q", q).to(dtype), self.query_bound, self.query_norm, "Q")

    def values(self, v: torch.Tensor) -> torch.Tensor:
        """v: [H, n, dv] -> clipped values, float64."""
        v = check_finite("V", v).to(torch.float64)
        return v.clamp(-self.value_bound, self.value_bound)

    def log_scale(self, q_mapped: torch.Tensor, kv_head: torch.Tensor) -> torch.Tensor:
        """``beta <q, mu_k>``: [H_q, m] log-factor between true and centred private logits."""
        if self.key_center is None:
            return q_mapped.new_zeros(q_mapped.shape[:-1])
        center = self.key_center.to(q_mapped)[kv_head]  # [H_q, d]
        return self.beta * torch.einsum("hmd,hd->hm", q_mapped, center)

    def _box(self, x: torch.Tensor, bound: float, norm: float | None, name: str) -> torch.Tensor:
        if not self.signed and (x < 0).any():
            raise ValueError(
                f"{name} has negative entries but the mapping is paper-literal (signed=False): "
                "the paper's setting needs inputs in [0, R]^d"
            )
        return _clip_norm(x.clamp(-bound, bound), norm)

    @staticmethod
    def calibrate(
        keys: torch.Tensor,
        queries: torch.Tensor,
        values: torch.Tensor,
        beta: float,
        quantile: float = 0.999,
        center: bool = True,
    ) -> HeadMapping:
        """Bounds from *public* calibration activations (``[H, n, d]`` each): the ``quantile`` of
        |entries| (and of row norms) after centring keys on their public mean."""
        keys = check_finite("public keys", keys).to(torch.float64)
        queries = check_finite("public queries", queries).to(torch.float64)
        values = check_finite("public values", values).to(torch.float64)
        key_center = keys.mean(dim=1) if center else None
        centred = keys - key_center[:, None, :] if center else keys
        q = lambda x: float(torch.quantile(x.flatten()[: 1 << 24], quantile))
        return HeadMapping(
            beta=beta,
            key_bound=q(centred.abs()),
            query_bound=q(queries.abs()),
            value_bound=q(values.abs()),
            key_norm=q(centred.norm(dim=-1)),
            query_norm=q(queries.norm(dim=-1)),
            key_center=key_center,
        )


def assert_same_heads(name: str, x: torch.Tensor, heads: int, dim: int | None = None) -> None:
    """Shape check with a clear message: ``x`` must be ``[heads, *, dim]``."""
    if x.dim() != 3 or x.shape[0] != heads or (dim is not None and x.shape[-1] != dim):
        expected = f"[{heads}, n, {dim if dim is not None else 'd'}]"
        raise ValueError(f"{name} must have shape {expected}, got {list(x.shape)}")

