"""Nearest-candidate search over the fixed public candidate table: the projection of a noisy
embedding back to a token (post-processing with public data, so its accuracy affects utility
only, never privacy).

For queries ``r [n, d]`` and candidate rows ``e [K, d]`` the nearest candidate minimises the
score ``s = ||e||^2 - 2 <e, r>`` (``||r||^2`` is constant per query), i.e. one GEMM per chunk of
queries. The search runs in two passes:

1. a *fast pass* (fp32 or bf16 GEMM, fp32 scores) keeps the ``k`` best candidates per query;
2. an *exact re-rank* computes ``||e - r||^2`` directly (float64) for those ``k`` and takes the
   minimum, ties going to the lowest candidate position (= lowest token id, candidates are sorted).

With fp32 rows the two passes are one certified search: the fp32 GEMM, then a ``SelectPass``
re-ranks only the rows within the GEMM's rounding-error bound of the best (``certified_nearest_fp32``;
``select_within_bound`` in torch, fused for CPU in ``kernels.nearest_select``).

The fast pass is a plain function with the ``FastPass`` signature so that a fused kernel in
``kernels/`` can replace ``fast_topk_torch`` without touching the rest. ``brute_force_nearest``
is the exact float64 reference used by the tests. Projection is post-processing of the noisy
vector with public data, so none of this affects privacy, only utility.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.nearest_reference import (
    direct_distances,
    fast_topk_torch,
    select_within_bound,
    squared_distance_scores,
)
from ..kernels.types import FastPass, SelectPass

BRUTE_FORCE_ELEMENTS = 1 << 22  # float64 elements of one brute-force [c, K, d] block (32 MiB)


def lowest_argmin(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per row of ``values [n, k]``, the entry of ``positions [n, k]`` (or ``[k]``) attaining the
    minimum value; among exact ties, the smallest position. Returns ``[n]`` int64."""
    positions = positions.expand_as(values)
    is_min = values == values.min(dim=1, keepdim=True).values
    sentinel = torch.iinfo(torch.int64).max
    return torch.where(is_min, positions, sentinel).min(dim=1).values


def rerank_exact(queries: torch.Tensor, rows: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Exact re-rank: among ``top [n, k]`` positions of ``rows [K, d]``, the one nearest to each
    query ``[n, d]`` by float64 ``direct_distances`` (no GEMM expansion); ties -> lowest position."""
    return lowest_argmin(direct_distances(rows[top], queries[:, None, :]), top)


FP32_UNIT_ROUNDOFF = 2.0**-24


def score_error_bound(queries: torch.Tensor, sq_norms: torch.Tensor) -> torch.Tensor:
    """``[n]`` fp32 bound on ``|computed - exact|`` of every fp32 GEMM score of each query ``[n, d]``
    against rows with squared norms ``sq_norms [K]``, in any summation order of the d + 1 terms.

    ``(gamma_{d+2} + u) (E^2 + 2 E ||r||)`` with ``u = 2^-24``, ``gamma_m = m u / (1 - m u)``, ``E``
    the largest row norm (Higham's bound for a sum of d + 1 terms with Cauchy-Schwarz; one extra
    ``u`` of margin covers the rounding of the bound and of ``best + slack`` themselves)."""
    d = queries.shape[1]
    u = FP32_UNIT_ROUNDOFF
    gamma = (d + 2) * u / (1.0 - (d + 2) * u)
    top_norm = float(sq_norms.max().sqrt()) if sq_norms.numel() else 0.0
    return (gamma + u) * (top_norm**2 + 2.0 * top_norm * queries.norm(dim=1))


def certified_nearest_fp32(
    queries: torch.Tensor,
    rows: torch.Tensor,
    sq_norms: torch.Tensor,
    select: SelectPass = select_within_bound,
) -> torch.Tensor:
    """Positions ``[n]`` in ``rows [K, d]`` (fp32) of the nearest row to each query ``[n, d]``
    (fp32), ties -> lowest position: the same answer as ``rerank_exact`` over every row, from
    one fp32 GEMM of scores ``||e||^2 - 2 <e, r>`` plus a direct re-rank of only the rows whose
    score is within twice ``score_error_bound`` of the best (usually one row per query): the
    nearest row's exact score is <= the best exact score, so its computed score is within
    2 tol of the best computed one."""
    scores = squared_distance_scores(queries, rows, sq_norms)  # [n, K] fp32
    return select(scores, 2.0 * score_error_bound(queries, sq_norms), queries, rows)


def brute_force_nearest(queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Exact reference: position in ``rows [K, d]`` of the nearest row to each query ``[n, d]``
    by direct float64 ``||e - r||^2`` over every row; ties -> lowest position. ``[n]`` int64."""
    rows64 = rows.to(torch.float64)
    every = torch.arange(rows.shape[0], device=rows.device)
    chunk = max(1, BRUTE_FORCE_ELEMENTS // rows64.numel())  # queries per [c, K, d] block
    parts = []
    for block in queries.to(torch.float64).split(chunk):
        parts.append(lowest_argmin(direct_distances(rows64[None, :, :], block[:, None, :]), every))
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

    def to(self, device: torch.device | str) -> CandidateIndex:
        """This index with every tensor on ``device``."""
        return CandidateIndex(*(t.to(device) for t in (self.ids, self.rows, self.sq_norms, self.fast_rows)))

    def nearest(
        self,
        queries: torch.Tensor,
        k: int = 32,
        chunk: int = 512,
        fast_pass: FastPass = fast_topk_torch,
        select: SelectPass = select_within_bound,
    ) -> torch.Tensor:
        """Token ids ``[n]`` (on the queries' device) of the nearest candidate to each query
        ``[n, d]`` (any float dtype, any device; searched on the index's device):
        fast-pass top-``k`` per chunk of ``chunk`` queries, then the exact re-rank (the default
        fp32 torch pass re-ranks only the rows its error bound cannot separate, with ``select``:
        ``certified_nearest_fp32``, same answer, no top-k)."""
        k = min(k, self.ids.shape[0])
        queries32 = queries.to(device=self.rows.device, dtype=torch.float32)
        if fast_pass is fast_topk_torch and self.fast_rows.dtype == torch.float32:
            # fp32 GEMM already: re-rank only the rows within its error bound of the best
            positions = [
                certified_nearest_fp32(block, self.rows, self.sq_norms, select)
                for block in queries32.split(chunk)
            ]
        else:
            positions = [
                rerank_exact(block, self.rows, fast_pass(block, self.fast_rows, self.sq_norms, k))
                for block in queries32.split(chunk)
            ]
        if not positions:
            return self.ids[:0].to(queries.device)
        return self.ids[torch.cat(positions)].to(queries.device)
