"""Approximate nearest-candidate search (``prompt.search: hnsw | ivf``): a faiss-cpu index over
the candidate rows, built once per table at start-up, whose top ``k`` per query are re-ranked
exactly (float64 ``rerank_exact``, ties -> lowest position).

Projection is post-processing of an already-private noisy vector with public data, so an
approximate search moves utility and speed, never privacy. The faiss index holds ONLY the
candidate rows (positions ``0..K-1`` of ``CandidateIndex.rows``), so every answer is a candidate
id: never a special id. A query for which faiss returns no position at all (an IVF probe of empty
lists) falls back to the exact search.

* ``hnsw``: ``IndexHNSWFlat`` (``HNSW_M`` links per node, ``HNSW_EF_CONSTRUCTION``), searched
  with ``efSearch = max(HNSW_EF_SEARCH, k)``;
* ``ivf``: ``IndexIVFFlat`` over ``ivf_nlist(K)`` k-means lists (``IVF_TRAIN_ITERATIONS``
  iterations, seeded), ``IVF_NPROBE`` lists probed per query.

Caveat measured on SmolLM2-135M-Instruct (49,135 candidates x 576, 2-core CPU; ``vllm-dp bench
prompt-ttft --search hnsw|ivf``): DP noise at useful epsilons is larger than the rows' norms
(clip norm 2.3; trlap_corrected at eps 10 adds noise of norm ~370), so queries lie far outside
the data, where graph and partition indexes lose recall: with these defaults only 20-60% of the
outputs equal the exact search's for trlap_corrected / laplace at eps 10-200, token preservation
drops by up to 2.4 pp (IVF) and 15.6 pp (HNSW) for gaussian_analytic at eps 200, and the search
is at best ~2x faster than the exact fp32 GEMM (which runs near the CPU's peak). The exact search
stays the default.
"""

from __future__ import annotations

import math

import torch

from .nearest import CandidateIndex, rerank_exact

APPROXIMATE_SEARCHES = ("hnsw", "ivf")
HNSW_M = 32  # links per node
HNSW_EF_CONSTRUCTION = 80  # candidate list while building
HNSW_EF_SEARCH = 128  # candidate list while searching (at least k)
IVF_NPROBE = 32  # lists probed per query
IVF_TRAIN_ITERATIONS = 10  # k-means iterations at start-up
IVF_SEED = 1234  # k-means initialisation (public: the table is public)
RERANK_TOP = 8  # faiss's best this many per query are re-ranked exactly (its fp32 distances are
# direct differences, accurate far below the gaps between neighbours; a float64 re-rank of 32 rows
# per query costs more than the faiss search itself)


def ivf_nlist(count: int) -> int:
    """Number of IVF lists for ``count`` candidates: about ``4 sqrt(count)``, at least 1 and at
    most ``count // 39`` (faiss wants >= 39 training points per centroid)."""
    return max(1, min(round(4 * math.sqrt(count)), count // 39))


def _faiss():
    try:
        import faiss
    except ImportError:
        raise ImportError("prompt.search hnsw / ivf needs faiss-cpu (pip install faiss-cpu)") from None
    return faiss


class ApproximateIndex:
    """A faiss ``kind`` (``hnsw`` | ``ivf``) index over ``exact``'s candidate rows, with
    ``CandidateIndex.nearest``'s interface. The search runs on CPU whatever the queries' device;
    ids come back on the queries' device. ``exact``: the (CPU) exact index it re-ranks with and
    falls back to."""

    def __init__(self, exact: CandidateIndex, kind: str, index, *, hnsw_m: int = HNSW_M,
                 ef_search: int = HNSW_EF_SEARCH, nprobe: int = IVF_NPROBE) -> None:
        self.exact, self.kind, self.index = exact, kind, index
        self.hnsw_m, self.ef_search, self.nprobe = hnsw_m, ef_search, nprobe

    @classmethod
    def build(cls, exact: CandidateIndex, kind: str, *, hnsw_m: int = HNSW_M,
              ef_construction: int = HNSW_EF_CONSTRUCTION, ef_search: int = HNSW_EF_SEARCH,
              nlist: int | None = None, nprobe: int = IVF_NPROBE) -> ApproximateIndex:
        """Build the faiss index of ``kind`` over ``exact.rows`` (public data; seconds for a
        50k x 576 table on 2 cores)."""
        if kind not in APPROXIMATE_SEARCHES:
            raise ValueError(f"approximate search must be one of {list(APPROXIMATE_SEARCHES)}, got {kind!r}")
        faiss = _faiss()
        exact = exact.to("cpu")
        rows = exact.rows.numpy()  # [K, d] fp32, C-contiguous
        count, dim = rows.shape
        if kind == "hnsw":
            index = faiss.IndexHNSWFlat(dim, hnsw_m)
            index.hnsw.efConstruction = ef_construction
            index.add(rows)
        else:
            lists = ivf_nlist(count) if nlist is None else nlist
            index = faiss.IndexIVFFlat(faiss.IndexFlatL2(dim), dim, lists)
            index.cp.niter = IVF_TRAIN_ITERATIONS
            index.cp.seed = IVF_SEED
            index.train(rows)
            index.add(rows)
        return cls(exact, kind, index, hnsw_m=hnsw_m, ef_search=ef_search, nprobe=nprobe)

    @property
    def ids(self) -> torch.Tensor:
        return self.exact.ids

    def describe(self) -> str:
        if self.kind == "hnsw":
            return f"faiss HNSW (M={self.hnsw_m}, efSearch={self.ef_search}) + exact re-rank"
        return f"faiss IVF-Flat (nlist={self.index.nlist}, nprobe={self.nprobe}) + exact re-rank"

    def to(self, device: torch.device | str) -> ApproximateIndex:
        """The index itself: faiss-cpu searches on CPU (queries are moved there)."""
        return self

    def positions(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        """faiss's top ``k`` positions ``[n, k]`` int64 for fp32 CPU ``queries [n, d]``; -1
        where it found fewer than ``k``."""
        faiss = _faiss()
        k = min(k, self.exact.ids.shape[0])
        if self.kind == "hnsw":  # per-call parameters: the shared index is never mutated
            params = faiss.SearchParametersHNSW(efSearch=max(self.ef_search, k))
        else:
            params = faiss.SearchParametersIVF(nprobe=self.nprobe)
        _, found = self.index.search(queries.contiguous().numpy(), k, params=params)
        return torch.from_numpy(found)

    def nearest(self, queries: torch.Tensor, k: int = 32, chunk: int = 512, fast_pass=None,
                select=None) -> torch.Tensor:
        """Candidate ids ``[n]`` (on the queries' device) of the approximately nearest candidate
        to each query ``[n, d]``: faiss's top ``min(k, RERANK_TOP)``, re-ranked exactly (float64),
        ties -> lowest id among those. ``chunk``: the exact fallback's; ``fast_pass``/``select``
        are accepted for ``CandidateIndex.nearest``'s signature and unused (the fallback runs the
        CPU torch passes)."""
        queries32 = queries.detach().to(device="cpu", dtype=torch.float32)
        if queries32.shape[0] == 0:
            return self.exact.ids[:0].to(queries.device)
        if not bool(torch.isfinite(queries32).all()):
            raise ValueError("nearest: non-finite queries (NaN or inf)")
        top = self.positions(queries32, min(k, RERANK_TOP))  # [n, k'], -1 = none
        missing = top < 0
        top = torch.where(missing, top[:, :1].clamp(min=0), top)  # pad with the best found
        positions = rerank_exact(queries32, self.exact.rows, top)
        empty = missing.all(dim=1)
        ids = self.exact.ids[positions]
        if bool(empty.any()):  # faiss found nothing for these: exact search
            ids[empty] = self.exact.nearest(queries32[empty], k, chunk)
        return ids.to(queries.device)


def search_index(exact: CandidateIndex, search: str) -> CandidateIndex | ApproximateIndex:
    """The index of ``prompt.search``: ``exact`` itself, or an ``ApproximateIndex`` over it."""
    if search == "exact":
        return exact
    return ApproximateIndex.build(exact, search)


def describe_search(index: CandidateIndex | ApproximateIndex) -> str:
    """One phrase for the start-up log: which nearest-candidate search runs where."""
    if isinstance(index, ApproximateIndex):
        return f"approximate, {index.describe()}, on cpu"
    if index.int8 is not None:
        return f"exact (certified int8 GEMM + float64 re-rank), on {index.rows.device}"
    if index.fast_rows.dtype == torch.bfloat16:
        return f"exact (bf16 top-k + float64 re-rank), on {index.rows.device}"
    return f"exact (certified fp32 GEMM + float64 re-rank), on {index.rows.device}"
