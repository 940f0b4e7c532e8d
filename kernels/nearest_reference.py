"""Torch references of the nearest-candidate kernels (``kernels.nearest``: the fast pass,
``kernels.nearest_select``: the certified fp32 selection); also the plain paths on any device.

Score of candidate row ``e`` for query ``r``: ``||e||^2 - 2 <e, r>`` (``||r||^2`` is constant per
query), one GEMM per chunk of queries.
"""

from __future__ import annotations

import torch


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
    n = scores.shape[0]
    threshold = scores.amin(dim=1) + slack  # [n]
    if not bool(torch.isfinite(threshold).all()):
        raise ValueError("select_within_bound: non-finite scores (NaN or inf queries)")
    query, row = torch.nonzero(scores <= threshold[:, None], as_tuple=True)  # (q, c) pairs
    dist = direct_distances(rows[row], queries[query])
    least = torch.full((n,), float("inf"), dtype=dist.dtype, device=dist.device)
    least = least.scatter_reduce(0, query, dist, reduce="amin")
    sentinel = torch.iinfo(torch.int64).max
    ties = torch.where(dist == least[query], row, sentinel)
    return torch.full((n,), sentinel, dtype=torch.int64, device=rows.device).scatter_reduce(
        0, query, ties, reduce="amin"
    )
