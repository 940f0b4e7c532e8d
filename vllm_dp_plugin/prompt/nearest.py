"""Nearest-candidate search over the fixed public candidate table (trlaplace spec 6.2.6).

For queries ``r [n, d]`` and candidate rows ``e [K, d]`` the nearest candidate minimises the
score ``s = ||e||^2 - 2 <e, r>`` (``||r||^2`` is constant per query), i.e. one GEMM per chunk of
queries. The search runs in two passes:

1. a *fast pass* (fp32 or bf16 GEMM, fp32 scores) keeps the ``k`` best candidates per query;
2. an *exact re-rank* computes ``||e - r||^2`` directly in fp32 for those ``k`` and takes the
   minimum, ties going to the lowest candidate position (= lowest token id, candidates are sorted).

The fast pass is a plain function with the ``FastPass`` signature so that a fused kernel in
``kernels/`` can replace ``fast_topk_torch`` without touching the rest. ``brute_force_nearest``
is the exact float64 reference used by the tests. Projection is post-processing of the noisy
vector with public data, so none of this affects privacy, only utility.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

BRUTE_FORCE_ELEMENTS = 1 << 22  # float64 elements of one brute-force [c, K, d] block (32 MiB)

FastPass = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``(queries [n, d] fp32, fast_rows [K, d] fp32|bf16, sq_norms [K] fp32, k) -> [n, k] int64``:
positions of (a superset approximation of) the k smallest scores of each query."""


def squared_distance_scores(
    queries: torch.Tensor, rows: torch.Tensor, sq_norms: torch.Tensor
) -> torch.Tensor:
    """``||e||^2 - 2 <e, r>`` for every query r ``[n, d]`` and row e ``[K, d]``: ``[n, K]``.

    Computed in the dtype of ``rows`` with fp32 (or wider) output; adding ``||r||^2`` gives the
    squared Euclidean distance up to rounding of the GEMM expansion.
    """
    out_dtype = torch.promote_types(sq_norms.dtype, torch.float32)
    dots = (queries.to(rows.dtype) @ rows.T).to(out_dtype)  # [n, K]
    return sq_norms.to(out_dtype)[None, :] - 2.0 * dots


def fast_topk_torch(
    queries: torch.Tensor, fast_rows: torch.Tensor, sq_norms: torch.Tensor, k: int
) -> torch.Tensor:
    """Torch ``FastPass``: positions ``[n, k]`` of the k smallest GEMM scores per query."""
    scores = squared_distance_scores(queries, fast_rows, sq_norms)  # [n, K] fp32
    return scores.topk(k, dim=1, largest=False).indices


def lowest_argmin(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per row of ``values [n, k]``, the entry of ``positions [n, k]`` (or ``[k]``) attaining the
    minimum value; among exact ties, the smallest position. Returns ``[n]`` int64."""
    positions = positions.expand_as(values)
    is_min = values == values.min(dim=1, keepdim=True).values
    sentinel = torch.iinfo(torch.int64).max
    return torch.where(is_min, positions, sentinel).min(dim=1).values


def rerank_exact(queries: torch.Tensor, rows: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Exact fp32 re-rank: among ``top [n, k]`` positions of ``rows [K, d]``, the one nearest to
    each query ``[n, d]`` by direct ``||e - r||^2`` (no GEMM expansion); ties -> lowest position."""
    diffs = rows[top] - queries[:, None, :].to(rows.dtype)  # [n, k, d]
    return lowest_argmin(diffs.pow(2).sum(-1), top)


FP32_UNIT_ROUNDOFF = 2.0**-24


def certified_nearest_fp32(queries: torch.Tensor, rows: torch.Tensor, sq_norms: torch.Tensor) -> torch.Tensor:
    """Positions ``[n]`` in ``rows [K, d]`` (fp32) of the nearest row to each query ``[n, d]``
    (fp32), ties -> lowest position: the same answer as ``rerank_exact`` over every row, from
    one fp32 GEMM of scores ``||e||^2 - 2 <e, r>`` plus a direct re-rank of only the rows whose
    score is within the GEMM's rounding-error bound of the best (usually one row per query).

    Bound: each computed score is within ``tol = (gamma_d + u) (E^2 + 2 E ||r||)`` of its exact
    value (``u = 2^-24``, ``gamma_d = d u / (1 - d u)``, ``E`` the largest row norm: Higham's dot
    product bound with Cauchy-Schwarz), so the nearest row's score is <= best + 2 tol."""
    n, d = queries.shape
    scores = squared_distance_scores(queries, rows, sq_norms)  # [n, K] fp32
    best = scores.min(dim=1).values  # [n]
    u = FP32_UNIT_ROUNDOFF
    gamma = d * u / (1.0 - d * u)
    top_norm = float(sq_norms.max().sqrt()) if rows.shape[0] else 0.0
    tol = (gamma + u) * (top_norm**2 + 2.0 * top_norm * queries.norm(dim=1))  # [n]
    query, row = torch.nonzero(scores <= (best + 2.0 * tol)[:, None], as_tuple=True)  # (q, c) pairs
    dist = (rows[row] - queries[query]).pow(2).sum(-1)  # direct fp32 ||e - r||^2 of each pair
    least = torch.full((n,), float("inf"), dtype=dist.dtype, device=dist.device)
    least = least.scatter_reduce(0, query, dist, reduce="amin")
    sentinel = torch.iinfo(torch.int64).max
    ties = torch.where(dist == least[query], row, sentinel)
    return torch.full((n,), sentinel, dtype=torch.int64, device=rows.device).scatter_reduce(
        0, query, ties, reduce="amin"
    )


def brute_force_nearest(queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Exact reference: position in ``rows [K, d]`` of the nearest row to each query ``[n, d]``
    by direct float64 ``||e - r||^2`` over every row; ties -> lowest position. ``[n]`` int64."""
    rows64 = rows.to(torch.float64)
    every = torch.arange(rows.shape[0], device=rows.device)
    chunk = max(1, BRUTE_FORCE_ELEMENTS // rows64.numel())  # queries per [c, K, d] block
    parts = []
    for block in queries.to(torch.float64).split(chunk):
        dist = (rows64[None, :, :] - block[:, None, :]).pow(2).sum(-1)  # [c, K]
        parts.append(lowest_argmin(dist, every))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=rows.device)


@dataclass(frozen=True, eq=False)
class CandidateIndex:
    """The candidate table prepared for nearest-neighbour search.

    ``ids [K]`` int64 token ids (sorted ascending), ``rows [K, d]`` fp32, ``sq_norms [K]`` fp32
    (``||rows||^2``), ``fast_rows [K, d]`` in the fast-pass dtype (fp32 or bf16).
    """

    ids: torch.Tensor
    rows: torch.Tensor
    sq_norms: torch.Tensor
    fast_rows: torch.Tensor

    @classmethod
    def build(
        cls, ids: torch.Tensor, rows: torch.Tensor, fast_dtype: torch.dtype = torch.float32
    ) -> CandidateIndex:
        """Index over candidate ``ids [K]`` whose embeddings are ``rows [K, d]`` (any float dtype)."""
        if fast_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"fast_dtype must be torch.float32 or torch.bfloat16, got {fast_dtype}"
            )
        rows32 = rows.to(torch.float32).contiguous()
        return cls(ids, rows32, rows32.pow(2).sum(-1), rows32.to(fast_dtype))

    def nearest(
        self,
        queries: torch.Tensor,
        k: int = 32,
        chunk: int = 512,
        fast_pass: FastPass = fast_topk_torch,
    ) -> torch.Tensor:
        """Token ids ``[n]`` of the nearest candidate to each query ``[n, d]`` (any float dtype):
        fast-pass top-``k`` per chunk of ``chunk`` queries, then the exact fp32 re-rank (the
        default fp32 torch pass re-ranks only the rows its error bound cannot separate:
        ``certified_nearest_fp32``, same answer, no top-k)."""
        k = min(k, self.ids.shape[0])
        queries32 = queries.to(device=self.rows.device, dtype=torch.float32)
        if fast_pass is fast_topk_torch and self.fast_rows.dtype == torch.float32:
            # fp32 GEMM already: re-rank only the rows within its error bound of the best
            positions = [certified_nearest_fp32(block, self.rows, self.sq_norms) for block in queries32.split(chunk)]
        else:
            positions = [
                rerank_exact(block, self.rows, fast_pass(block, self.fast_rows, self.sq_norms, k))
                for block in queries32.split(chunk)
            ]
        if not positions:
            return self.ids[:0]
        return self.ids[torch.cat(positions)]
