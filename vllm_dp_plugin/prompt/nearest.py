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
``select_within_bound`` in torch, fused for CPU in ``kernels.nearest_select``). With int8 rows
(``fast_dtype`` int8, the CPU default) the GEMM is an exact int8 x int8 -> int32 product of the
quantised rows and queries (``torch._int_mm``: 512 x 49k x 576 in ~17 ms against ~230 ms for
the fp32 GEMM on a 2-core CPU with AVX-512 VNNI), and the
re-rank takes every row whose per-pair quantisation bound can reach the best
(``certified_nearest_int8``; ~40 rows per query on SmolLM2's table at eps 10): the same answer.

The fast pass is a plain function with the ``FastPass`` signature so that a fused kernel in
``kernels/`` can replace ``fast_topk_torch`` without touching the rest. ``brute_force_nearest``
is the exact float64 reference used by the tests. Projection is post-processing of the noisy
vector with public data, so none of this affects privacy, only utility.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import torch

from ..kernels.nearest_reference import (
    direct_distances,
    fast_topk_torch,
    select_within_bound,
    squared_distance_scores,
)
from ..kernels.nearest_select import default_select_int8
from ..kernels.types import FastPass, Int8Rows, Int8SelectPass, SelectPass

FAST_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
INT8_GRAM_BYTES = 1 << 26  # the int8 pass's reused [chunk, K] int32 buffer, per searching thread (64 MiB)
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


INT8_MARGIN = 1e-11  # float64 slack of the int8 bound, relative to ||e||^2 + ||r||^2
# Query codes in [-127, 127]; row codes in [-127, 127] where the int8 GEMM is exact with them, else
# [-63, 63]: without VNNI (AVX2, AVX-512 before VNNI) oneDNN's int8 GEMM shifts the first operand by
# 128 to u8 and adds pairs of u8 x s8 products in saturating int16, exact only while
# 255 * 63 * 2 <= 32767 (measured with ONEDNN_MAX_CPU_ISA=AVX2: full-range rows give wrong sums,
# 7-bit rows never do). ``row_code_max`` probes which holds, once per process.
QUERY_CODE_MAX = 127
ROW_CODE_MAXES = (127, 63)


def quantize_int8(vectors: torch.Tensor, code_max: int = QUERY_CODE_MAX) -> Int8Rows:
    """``Int8Rows`` of ``vectors [m, d]`` (fp32 values): one symmetric scale per vector,
    ``max |v| / code_max`` (1 for a zero vector), codes ``round(v / scale)`` in
    ``[-code_max, code_max]``; every norm in float64."""
    v = vectors.to(torch.float64)
    scale = v.abs().amax(dim=1) / code_max if v.shape[1] else v.new_ones(v.shape[0])
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(v / scale[:, None]).clamp_(-code_max, code_max)
    coded = codes * scale[:, None]
    return Int8Rows(codes.to(torch.int8), scale, (v - coded).norm(dim=1), coded.norm(dim=1), v.pow(2).sum(1))


def int8_gemm_exact(row_max: int) -> bool:
    """Whether ``torch._int_mm`` on this CPU sums query codes of [-127, 127] against row codes of
    ``[-row_max, row_max]`` exactly: extreme and random codes against the int64 product."""
    gen = torch.Generator().manual_seed(0)
    queries = torch.randint(-QUERY_CODE_MAX, QUERY_CODE_MAX + 1, (32, 576), generator=gen, dtype=torch.int8)
    rows = torch.randint(-row_max, row_max + 1, (64, 576), generator=gen, dtype=torch.int8)
    queries[:8] = QUERY_CODE_MAX * queries[:8].sign()
    rows[:8] = row_max * rows[:8].sign()
    return torch.equal(torch._int_mm(queries, rows.T).long(), queries.long() @ rows.long().T)


@functools.cache
def row_code_max() -> int:
    """The widest row code range of ``ROW_CODE_MAXES`` the int8 GEMM sums exactly on this CPU
    (127 with VNNI, 63 without), or 0 when none (once per process)."""
    return next((m for m in ROW_CODE_MAXES if int8_gemm_exact(m)), 0)


def certified_nearest_int8(
    queries: torch.Tensor, rows: torch.Tensor, rows8: Int8Rows, select: Int8SelectPass,
    gram: torch.Tensor | None = None,
) -> torch.Tensor:
    """Positions ``[n]`` in ``rows [K, d]`` (fp32, quantised as ``rows8``) of the nearest row to each
    query ``[n, d]`` (fp32), ties -> lowest position: the same answer as ``rerank_exact`` over every
    row, from one exact int8 GEMM of the codes plus a direct re-rank of the rows its bound cannot
    exclude.

    With ``e = a E + de`` and ``r = b R + dr`` (codes E, R; scales a, b), ``<e, r> - a b <E, R> =
    <de, r> + <a E, dr>``, so the computed score ``c = ||e||^2 - 2 a b <E, R>`` lies within
    ``t = 2 (||de|| ||r|| + ||a E|| ||dr||)`` of the exact one (Cauchy-Schwarz; ``<E, R>`` is an
    exact int32). ``U = min (c + t)`` bounds the nearest row's exact score from above, so the
    nearest row has ``c - t <= U``; only those rows are re-ranked. ``INT8_MARGIN (||e||^2 + ||r||^2)``
    in ``t`` covers the float64 rounding of the scores, the norms and the re-rank's distances
    (each <= ~(d + 2) 2^-53 of that scale). ``gram``: an int32 buffer of at least ``n * K``
    elements to write the products into (a fresh 100 MB tensor per call costs more in page faults
    than the GEMM itself). Raises ValueError on non-finite queries."""
    if not bool(torch.isfinite(queries).all()):
        raise ValueError("nearest-candidate search: non-finite queries (NaN or inf)")
    q8 = quantize_int8(queries)
    shape = (queries.shape[0], rows.shape[0])
    out = None if gram is None else gram.view(-1)[: shape[0] * shape[1]].view(shape)
    gram = torch._int_mm(q8.codes, rows8.codes.T, out=out)  # [n, K] int32, exact: |<E, R>| <= 127^2 d
    return select(gram, q8, rows8, INT8_MARGIN, queries, rows)


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
    (``||rows||^2``), ``fast_rows [K, d]`` in the fast-pass dtype (fp32, bf16, or int8: the codes of ``int8``,
    the rows quantised for the certified int8 pass; ``int8`` is None for the other dtypes).
    ``scratch``: per-thread buffers of the int8 pass (``_gram``).
    """

    ids: torch.Tensor
    rows: torch.Tensor
    sq_norms: torch.Tensor
    fast_rows: torch.Tensor
    int8: Int8Rows | None = None
    scratch: threading.local = field(default_factory=threading.local, repr=False)  # int8: gram buffers

    @classmethod
    def build(
        cls, ids: torch.Tensor, rows: torch.Tensor, fast_dtype: torch.dtype = torch.float32
    ) -> CandidateIndex:
        """Index over candidate ``ids [K]`` whose embeddings are ``rows [K, d]`` (any float dtype)."""
        if fast_dtype not in FAST_DTYPES:
            raise ValueError(
                f"fast_dtype must be torch.float32, torch.bfloat16 or torch.int8, got {fast_dtype}"
            )
        rows32 = rows.to(torch.float32).contiguous()
        if fast_dtype == torch.int8:
            if not row_code_max():
                raise ValueError("torch._int_mm is not exact on this CPU: use fast_dtype float32")
            rows8 = quantize_int8(rows32, row_code_max())
            return cls(ids, rows32, rows32.pow(2).sum(-1), rows8.codes, rows8)
        return cls(ids, rows32, rows32.pow(2).sum(-1), rows32.to(fast_dtype))

    def _gram(self, n: int) -> torch.Tensor:
        """This thread's int32 buffer of at least ``n * K`` elements (grown, then reused)."""
        need = n * self.rows.shape[0]
        buffer = getattr(self.scratch, "gram", None)
        if buffer is None or buffer.numel() < need:
            buffer = self.scratch.gram = torch.empty(need, dtype=torch.int32, device=self.rows.device)
        return buffer

    def to(self, device: torch.device | str) -> CandidateIndex:
        """This index with every tensor on ``device``."""
        int8 = None if self.int8 is None else Int8Rows(*(t.to(device) for t in vars(self.int8).values()))
        return CandidateIndex(*(t.to(device) for t in (self.ids, self.rows, self.sq_norms, self.fast_rows)), int8)

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
        ``certified_nearest_fp32``, same answer, no top-k; int8 rows: ``certified_nearest_int8``
        with the fused CPU selection where built, whatever ``fast_pass`` and ``select``)."""
        k = min(k, self.ids.shape[0])
        queries32 = queries.to(device=self.rows.device, dtype=torch.float32)
        if self.int8 is not None:
            select8 = default_select_int8(self.rows.device)
            chunk = max(1, min(chunk, INT8_GRAM_BYTES // (4 * self.rows.shape[0])))
            gram = self._gram(min(chunk, queries32.shape[0]))
            positions = [
                certified_nearest_int8(block, self.rows, self.int8, select8, gram) for block in queries32.split(chunk)
            ]
        elif fast_pass is fast_topk_torch and self.fast_rows.dtype == torch.float32:
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
