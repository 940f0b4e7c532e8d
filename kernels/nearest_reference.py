"""Torch references of the nearest-candidate kernels (``kernels.nearest``: the fast pass,
``kernels.nearest_select``: the certified fp32 and int8 selections); also the plain paths on any device.

Score of candidate row ``e`` for query ``r``: ``||e||^2 - 2 <e, r>`` (``||r||^2`` is constant per
query), one GEMM per chunk of queries.
"""

from __future__ import annotations

import torch

from .types import Int8Rows


def squared_distance_scores(
    queries: torch.Tensor, rows: torch.Tensor, sq_norms: torch.Tensor
) -> torch.Tensor:
    """``||e||^2 - 2 <e, r>`` for every query r ``[n, d]`` and row e ``[K, d]``: ``[n, K]``.

    Computed in the dtype of ``rows`` with fp32 (or wider) output; adding ``||r||^2`` gives the
    squared Euclidean distance up to rounding of the GEMM expansion. fp32 rows: one fused
    ``addmm`` (the factor -2 is exact).
    """
    if rows.dtype == sq_norms.dtype == torch.float32:
        return torch.addmm(sq_norms, queries.to(rows.dtype), rows.T, alpha=-2.0)
    out_dtype = torch.promote_types(sq_norms.dtype, torch.float32)
    dots = (queries.to(rows.dtype) @ rows.T).to(out_dtype)  # [n, K]
    return sq_norms.to(out_dtype)[None, :] - 2.0 * dots


def fast_topk_torch(
    queries: torch.Tensor, fast_rows: torch.Tensor, sq_norms: torch.Tensor, k: int
) -> torch.Tensor:
    """Torch ``FastPass``: positions ``[n, k]`` of the k smallest GEMM scores per query."""
    scores = squared_distance_scores(queries, fast_rows, sq_norms)  # [n, K] fp32
    return scores.topk(k, dim=1, largest=False).indices


def direct_distances(rows: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """float64 ``||e - r||^2`` of paired rows ``[..., d]`` and queries ``[..., d]`` (broadcast):
    the differences are exact and the sum carries float64 rounding only."""
    return (rows.to(torch.float64) - queries.to(torch.float64)).pow(2).sum(-1)


def select_within_bound(
    scores: torch.Tensor, slack: torch.Tensor, queries: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """Torch ``SelectPass`` (the reference of ``kernels.nearest_select``). Raises ValueError when
    a query's scores are not finite."""
    threshold = scores.amin(dim=1) + slack  # [n]
    if not bool(torch.isfinite(threshold).all()):
        raise ValueError("select_within_bound: non-finite scores (NaN or inf queries)")
    return nearest_among(scores <= threshold[:, None], queries, rows)


def select_int8(
    gram: torch.Tensor, q: Int8Rows, r: Int8Rows, margin: float, queries: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """Torch ``Int8SelectPass`` (the reference of ``kernels.nearest_select.select_int8``; float64
    ``[n, K]`` temporaries). Raises ValueError when a query's scores are not finite."""
    score = r.sq[None, :] - 2.0 * (q.scale[:, None] * r.scale[None, :]) * gram.to(torch.float64)
    slack = (2.0 * (r.err[None, :] * q.sq.sqrt()[:, None] + r.coded_norm[None, :] * q.err[:, None])
             + margin * (r.sq[None, :] + q.sq[:, None]))
    upper = (score + slack).amin(dim=1)  # [n]
    if not bool(torch.isfinite(upper).all()):
        raise ValueError("select_int8: non-finite scores (NaN or inf queries)")
    return nearest_among(score - slack <= upper[:, None], queries, rows)


def nearest_among(window: torch.Tensor, queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """For each query ``[n, d]``, the row of ``rows [K, d]`` nearest by float64 ``direct_distances``
    among those ``window [n, K]`` (bool, at least one per query) admits; ties -> lowest position."""
    n = window.shape[0]
    query, row = torch.nonzero(window, as_tuple=True)  # (q, c) pairs
    dist = direct_distances(rows[row], queries[query])
    least = torch.full((n,), float("inf"), dtype=dist.dtype, device=dist.device)
    least = least.scatter_reduce(0, query, dist, reduce="amin")
    sentinel = torch.iinfo(torch.int64).max
    ties = torch.where(dist == least[query], row, sentinel)
    return torch.full((n,), sentinel, dtype=torch.int64, device=rows.device).scatter_reduce(
        0, query, ties, reduce="amin"
    )
