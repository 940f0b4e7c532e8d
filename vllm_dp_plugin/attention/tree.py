"""Mode B ``tree``: the vectorised, faithful DPTree cross-attention release (GPU formulation).

Same output distribution as the literal Alg. 1-7 oracle (``reference``) for the same
``TreeSpec``; with the same injected node noise (canonical layout of ``tree_spec``) the same
answers up to float64 summation order. Per KV head h, weight column w (W = d_v + 1, the last one
all ones = the softmax denominator), copy c and feature f there is one DPTreeDistance(p = 2)
over ``u_j = PK[h, j, f]`` in ``[lo_f, hi_f]`` with N leaves:

* leaf ``bin(u) = clamp(floor((u - lo) N / (hi - lo)), 0, N - 1)`` (0-based) holds the exact
  moments ``sum_j Wt[h, j, w] u_j^q``, q = 0, 1, 2; internal nodes are level sums; every node
  but the root gets independent TLap noise (scale ``spec.sensitivity[w, f, q] * unit``);
* ``DistanceQuery(y) = y^2 S_0 - 2 y S_1 + S_2`` with ``S_q`` = the sum of the noisy SIBLINGS of
  y's leaf's root path (one per layer: ``c_left + c_right`` of Alg. 2; the own leaf is excluded
  on purpose: adding its exact value back would make answers no longer post-processing of the
  noisy tree);
* ``P_wx = sum_f DistanceQuery_f(0)``; ``s_w`` = the s_w tree (data all 1 over ``[0, sw_hi]``,
  moment 2 only) queried at 0; ``answer(v) = 1/2 (P_wx + s_w ||v||^2 - sum_f DistanceQuery_f(v_f))``
  per copy, median over the C copies.

Build (chunked over rectangles of (heads, features)): ``leaf_histogram`` (kernel) -> exact level sums -> node noise
(sampled level by level with ``generator``, or sliced from injected tensors) -> the PATH-SUM TABLE
``PS[h, f, leaf, c, q, w] = sum of the noisy siblings along leaf's root path``, computed top-down
one op per level (``acc_k[u] = acc_{k-1}[u >> 1] + noisy_k[u ^ 1]``); the tree itself, the keys,
weights and exact leaves are dropped. Query: ``gather_contract`` (kernel) in float64.

Memory / dtype decisions:
* Stored state = ``PS`` as ``[H, F, N, C*3*W]`` in ``dtype`` (float32 default: serving/bench,
  4 H F N C 3 W bytes; float64 doubles it and is what tests use to compare with the
  oracle at 1e-9) + ``P_wx``, ``s_w`` ``[H, C, W]`` float64 (computed from the float64 table
  before the cast). Everything is built and contracted in float64; only storage is rounded, and
  fp32 rounding (~6e-8 relative per entry) is negligible next to the DP noise it stores.
* Build peak on top of the table: about ``8 * chunk_bytes`` (one chunk's float64 path sums are
  capped at ``chunk_bytes``; its exact leaves and levels, the top level's noise sampling
  temporaries and the noisy top level add the rest). Measured for H = 1, n = 4096 (N = 4096),
  F = W = 65, C = 1: table 198 MiB (fp32), build temporaries ~500 MiB at the default 64 MiB
  chunks, ~125 MiB at 16 MiB chunks. Injected noise is the caller's tensor (canonical layout,
  ``8 H W C F 3 2N`` bytes: small sizes only).
* Sampled noise is drawn level by level per F-chunk: same law as ``sample_tree_noise`` but not the
  same stream for a given generator state.

``TreeMode`` is the ``mode="tree"`` entry of the release-mode registry (``modes``); the
``reference`` mode reuses it with the literal per-head oracle as its ``build``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ..kernels.tree_build import bin_index, leaf_histogram, plan_chunks
from ..kernels.tree_query import gather_contract
from ..privacy.noise import LaplaceNoise
from .accounting import tree_mechanism
from .tree_spec import TreeSpec

if TYPE_CHECKING:
    from ..privacy.mechanisms import Mechanism
    from .base import HeadGenerators, Release, ReleaseContext

MOMENTS = 3
DEFAULT_CHUNK_BYTES = 1 << 26
RANGE_TOLERANCE = 1e-9  # relative to hi - lo: pk may exceed [lo, hi] by rounding only
_DTYPES = (torch.float32, torch.float64)

NoiseSource = Callable[[int, int], torch.Tensor]  # (level start 2^k, level end 2^{k+1}) -> noise


class TreeRelease:
    """The released (noisy) state of H heads' DPTree cross-attention; build with ``build``."""

    def __init__(
        self,
        table: torch.Tensor,
        p_wx: torch.Tensor,
        s_w: torch.Tensor,
        lo: torch.Tensor,
        hi: torch.Tensor,
        leaves: int,
        copies: int,
    ) -> None:
        self.table = table  # [H, F, N, C*3*W] path sums of noisy siblings
        self.p_wx = p_wx  # [H, C, W] float64
        self.s_w = s_w  # [H, C, W] float64
        self.lo = lo
        self.hi = hi
        self.leaves = leaves
        self.copies = copies

    @property
    def heads(self) -> int:
        return self.table.shape[0]

    @property
    def features(self) -> int:
        return self.table.shape[1]

    @property
    def columns(self) -> int:
        return self.p_wx.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored release (path-sum table + constants + ranges)."""
        return sum(t.numel() * t.element_size() for t in (self.table, self.p_wx, self.s_w, self.lo, self.hi))

    @staticmethod
    def planned_nbytes(spec: TreeSpec, heads: int, dtype: torch.dtype = torch.float32) -> int:
        """``nbytes`` of a release of ``heads`` heads for ``spec``, before building it."""
        W, F = spec.sensitivity.shape[:2]
        itemsize = torch.empty((), dtype=dtype).element_size()
        table = heads * F * spec.leaves * spec.copies * MOMENTS * W * itemsize
        return table + 2 * heads * spec.copies * W * 8 + 2 * F * 8

    @classmethod
    def build(
        cls,
        pk: torch.Tensor,
        weights: torch.Tensor,
        spec: TreeSpec,
        generator: torch.Generator,
        noise: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> TreeRelease:
        """Release for keys' features ``pk [H, n, F]`` and weights ``[H, n, W]`` (float64).

        ``noise``: optional ``(feature [H, W, C, F, 3, 2N], sw [H, W, C, 2N])`` node noise in the
        canonical layout (``tree_spec``); otherwise fresh TLap noise from ``generator``.
        ``dtype``: storage of the path-sum table (float32 or float64, see module doc)."""
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        _check_spec(spec)
        H, n, F, W = _check_data(pk, weights, spec)
        N, C, L = spec.leaves, spec.copies, spec.levels
        if noise is not None:
            _check_noise(noise, H, W, C, F, N)
        device = pk.device
        lo = spec.lo.to(device=device, dtype=torch.float64)
        hi = spec.hi.to(device=device, dtype=torch.float64)
        origin_bins = bin_index(torch.zeros(F, dtype=torch.float64, device=device), lo, hi, N)
        sw_lo = torch.zeros(1, dtype=torch.float64, device=device)
        sw_hi = torch.full((1,), float(spec.sw_hi), dtype=torch.float64, device=device)
        sw_origin = int(bin_index(sw_lo, sw_lo, sw_hi, N))
        scale, ratio = spec.feature_noise_scale()
        sw_scale, sw_ratio = spec.sw_noise_scale()
        scale = scale.to(dtype=torch.float64, device=generator.device)
        sw_scale = sw_scale.to(dtype=torch.float64, device=generator.device)
        feature_law, sw_law = LaplaceNoise(1.0, ratio), LaplaceNoise(1.0, sw_ratio)

        table = torch.empty(H, F, N, C * MOMENTS * W, dtype=dtype, device=device)
        p_wx = torch.zeros(H, C, W, dtype=torch.float64, device=device)
        s_w = torch.empty(H, C, W, dtype=torch.float64, device=device)
        slab = 8 * N * C * MOMENTS * W  # float64 path sums of one (head, feature)
        for h0, h1, f0, f1 in plan_chunks(H, F, slab, chunk_bytes):
            Hc, Fc = h1 - h0, f1 - f0
            wt = weights[h0:h1].to(torch.float64)
            if f0 == 0:  # s_w tree: data all 1 over [0, sw_hi], moment 2 only, queried at 0
                ones = torch.ones(Hc, n, 1, dtype=torch.float64, device=device)
                sw_leaves = leaf_histogram(ones, wt, sw_lo, sw_hi, N)[:, 0, :, 2:3, :]  # [Hc, N, 1, W]
                if noise is not None:
                    sw_view = noise[1][h0:h1].permute(1, 2, 0, 3)[:, :, :, None, None, :]
                    source = _slicer(sw_view, device)  # [W, C, Hc, 1, 1, 2N]
                else:
                    scale_sw = sw_scale[:, None, None, None, None]
                    source = _sampler(sw_law, (W, C, Hc, 1), scale_sw, generator, device)
                s_w[h0:h1] = _path_sums(sw_leaves, source, L, C)[:, sw_origin, :, 0, :]
                del ones, sw_leaves
            leaves = leaf_histogram(pk[h0:h1, :, f0:f1], wt, lo[f0:f1], hi[f0:f1], N)
            leaves = leaves.reshape(Hc * Fc, N, MOMENTS, W)
            if noise is not None:
                source = _slicer(noise[0][h0:h1, :, :, f0:f1].permute(1, 2, 0, 3, 4, 5), device)
            else:
                scale_chunk = scale[:, f0:f1].repeat(1, Hc, 1)[:, None, :, :, None]  # (h, f) order
                source = _sampler(feature_law, (W, C, Hc * Fc, MOMENTS), scale_chunk, generator, device)
            ps = _path_sums(leaves, source, L, C).view(Hc, Fc, N, C, MOMENTS, W)
            del leaves
            at_origin = ps[..., 2, :][:, torch.arange(Fc, device=device), origin_bins[f0:f1]]
            p_wx[h0:h1] += at_origin.sum(1)  # sum_f DistanceQuery_f(0) = moment-2 path sums
            table[h0:h1, f0:f1] = ps.view(Hc, Fc, N, C * MOMENTS * W)
            del ps, at_origin
        return cls(table, p_wx, s_w, lo, hi, N, C)

    @classmethod
    def stack(cls, releases: Sequence[TreeRelease]) -> TreeRelease:
        """One release answering the heads of ``releases`` (same spec) in order: post-processing."""
        first = releases[0]
        if any((r.leaves, r.copies) != (first.leaves, first.copies) for r in releases):
            raise ValueError("only releases of the same tree spec can be stacked")
        cat = lambda name: torch.cat([getattr(r, name) for r in releases])
        return cls(cat("table"), cat("p_wx"), cat("s_w"), first.lo, first.hi, first.leaves, first.copies)

    def answer_copies(self, pq: torch.Tensor) -> torch.Tensor:
        """Per-copy answers ``[H, m, C, W]`` float64 for query features ``pq [H, m, F]``."""
        pq = self._check_queries(pq)
        bins = bin_index(pq, self.lo, self.hi, self.leaves)
        value = gather_contract(self.table, bins, pq, self.copies)  # [H, m, C, W]
        norm2 = (pq * pq).sum(-1)[..., None, None]
        return 0.5 * (self.p_wx[:, None] + self.s_w[:, None] * norm2 - value)

    def answer(self, pq: torch.Tensor) -> torch.Tensor:
        """``[H, m, W]`` float64: median over the copies of ``answer_copies(pq)``."""
        per_copy = self.answer_copies(pq)
        if self.copies == 1:
            return per_copy[:, :, 0]
        return per_copy.median(dim=2).values

    def _check_queries(self, pq: torch.Tensor) -> torch.Tensor:
        if not isinstance(pq, torch.Tensor) or pq.dim() != 3:
            raise ValueError(f"pq must be a [H, m, F] tensor, got {_shape(pq)}")
        if pq.shape[0] != self.heads or pq.shape[2] != self.features:
            raise ValueError(
                f"pq shape {tuple(pq.shape)} does not match the release's "
                f"H={self.heads} heads and F={self.features} features"
            )
        if not pq.is_floating_point() or not torch.isfinite(pq).all():
            raise ValueError("pq must be finite floating-point query features (NaN/inf found)")
        return pq.to(device=self.table.device, dtype=torch.float64)


class TreeMode:
    """``mode="tree"`` (``ReleaseMode``): the rows are collected until the release, which needs
    all of them (``TreeRows``); one generator per KV head builds head by head and ``stack``s.
    Queries run in float64 (P_wx and Value are large and nearly cancel)."""

    def query_dtype(self, layer: ReleaseContext) -> torch.dtype:
        return torch.float64

    def mechanism(self, layer: ReleaseContext, n: int) -> Mechanism:
        return tree_mechanism(layer.tree_budget(n), float(layer.tree_spec(n).sensitivity[0, 0, 0]))

    def planned_nbytes(self, layer: ReleaseContext, n: int) -> int:
        """The fp32 path-sum table and its constants; ``params.memory_limit_bytes`` caps it."""
        return TreeRelease.planned_nbytes(layer.tree_spec(n), layer.kv_heads)

    def builder(self, layer: ReleaseContext, device: torch.device) -> TreeRows:
        return TreeRows(self, layer)

    def build(
        self, layer: ReleaseContext, pk: torch.Tensor, weights: torch.Tensor, generator: torch.Generator
    ) -> Release:
        """All heads of ``pk: [H, n, F]``, ``weights: [H, n, W]`` from one generator."""
        return TreeRelease.build(pk, weights, layer.tree_spec(pk.shape[1]), generator)

    def stack(self, releases: Sequence[Release]) -> Release:
        """One release of the heads of ``releases`` (built head by head), in order."""
        return TreeRelease.stack(releases)

    def query_path(self, layer: ReleaseContext, release: Release) -> None:
        return None


class TreeRows:
    """``ReleaseBuilder`` of the tree modes: the mapped rows, kept until the release."""

    def __init__(self, mode: TreeMode, layer: ReleaseContext) -> None:
        self.mode, self.layer = mode, layer
        self.chunks: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, pk: torch.Tensor, weights: torch.Tensor) -> None:
        self.chunks.append((pk, weights))

    def release(self, mechanism: Mechanism, generator: HeadGenerators) -> Release:
        """Check the memory cap (nothing is dropped if it refuses), then build and drop the rows.
        The noise comes from the tree spec (``mechanism`` is its ledger summary)."""
        layer = self.layer
        n = sum(pk.shape[1] for pk, _ in self.chunks)
        need = self.mode.planned_nbytes(layer, n)
        if need > layer.params.memory_limit_bytes:
            raise ValueError(
                f"tree mode needs ~{need / 2**30:.2f} GiB for n={n}, r={layer.features.dim} "
                f"(> memory_limit_bytes={layer.params.memory_limit_bytes / 2**30:.2f} GiB); use "
                "mode='state', a lower degree, or raise the limit"
            )
        pk = torch.cat([c[0] for c in self.chunks], dim=1)  # [H, n, F]
        weights = torch.cat([c[1] for c in self.chunks], dim=1)  # [H, n, W]
        self.chunks.clear()
        if isinstance(generator, torch.Generator):
            return self.mode.build(layer, pk, weights, generator)
        heads = [self.mode.build(layer, pk[h : h + 1], weights[h : h + 1], g) for h, g in enumerate(generator)]
        return self.mode.stack(heads)


def _slicer(noise: torch.Tensor, device) -> NoiseSource:
    """Injected heap-indexed noise viewed as ``[W, C, *batch, Q, 2N]``: one level's nodes as
    ``[W, C, prod(batch), Q, level size]`` float64."""
    W, C, Q = noise.shape[0], noise.shape[1], noise.shape[-2]

    def level(start: int, end: int) -> torch.Tensor:
        z = noise[..., start:end].to(device=device, dtype=torch.float64)
        return z.reshape(W, C, -1, Q, end - start)

    return level


def _sampler(
    law: LaplaceNoise, shape: tuple[int, ...], scale: torch.Tensor, generator: torch.Generator, device
) -> NoiseSource:
    """Fresh i.i.d. ``scale * TLap(1, ratio)`` noise ``[*shape, level size]`` per level."""

    def level(start: int, end: int) -> torch.Tensor:
        z = law.sample((*shape, end - start), generator)
        z *= scale
        return z.to(device)

    return level


def _path_sums(leaves: torch.Tensor, noise: NoiseSource, levels: int, copies: int) -> torch.Tensor:
    """``leaves [Fc, N, Q, W]`` exact leaf moments -> ``[Fc, N, C, Q, W]`` float64 sums of the
    noisy siblings on each leaf's root path (layers 1..L; the root is never touched)."""
    Fc, N, Q, W = leaves.shape
    if N != 1 << levels:
        raise ValueError(f"{N} leaves do not make a tree of {levels} levels")
    exact = [leaves]  # exact[i] is layer L - i
    for k in range(levels, 1, -1):
        exact.append(exact[-1].view(Fc, 1 << (k - 1), 2, Q, W).sum(2))
    exact.reverse()  # exact[k - 1] is layer k: heap nodes 2^k .. 2^{k+1} - 1
    acc = torch.zeros(Fc, 1, copies, Q, W, dtype=torch.float64, device=leaves.device)
    for k in range(1, levels + 1):
        size = 1 << k
        noisy = noise(size, 2 * size).permute(2, 4, 1, 3, 0)  # [Fc, 2^k, C, Q, W]
        noisy = noisy + exact[k - 1][:, :, None]  # c[node] = b[node] + TLap
        exact[k - 1] = None
        acc = acc.repeat_interleave(2, dim=1)
        pairs = acc.view(Fc, size // 2, 2, copies, Q, W)
        sibs = noisy.reshape(Fc, size // 2, 2, copies, Q, W)
        pairs[:, :, 0] += sibs[:, :, 1]  # a left child reads its right sibling (c_right)
        pairs[:, :, 1] += sibs[:, :, 0]  # a right child reads its left sibling (c_left)
        del noisy, sibs, pairs
    return acc


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _check_spec(spec: TreeSpec) -> None:
    N = spec.leaves
    if N < 2 or N & (N - 1):
        raise ValueError(f"spec.leaves must be a power of two >= 2, got {N}")
    if spec.copies < 1:
        raise ValueError(f"spec.copies must be >= 1, got {spec.copies}")
    if spec.sensitivity.dim() != 3 or spec.sensitivity.shape[2] != MOMENTS:
        raise ValueError(f"spec.sensitivity must be [W, F, 3], got {tuple(spec.sensitivity.shape)}")
    F = spec.sensitivity.shape[1]
    if spec.lo.shape != (F,) or spec.hi.shape != (F,):
        raise ValueError(f"spec.lo/hi must be [F={F}], got {tuple(spec.lo.shape)}, {tuple(spec.hi.shape)}")
    if not bool((spec.hi > spec.lo).all()):
        raise ValueError("spec ranges need hi > lo for every feature")
    if not spec.sw_hi > 0:
        raise ValueError(f"spec.sw_hi must be > 0, got {spec.sw_hi}")


def _check_data(pk: torch.Tensor, weights: torch.Tensor, spec: TreeSpec) -> tuple[int, int, int, int]:
    if not isinstance(pk, torch.Tensor) or pk.dim() != 3:
        raise ValueError(f"pk must be a [H, n, F] tensor, got {_shape(pk)}")
    if not isinstance(weights, torch.Tensor) or weights.dim() != 3:
        raise ValueError(f"weights must be a [H, n, W] tensor, got {_shape(weights)}")
    H, n, F = pk.shape
    W, spec_f = spec.sensitivity.shape[:2]
    if weights.shape[:2] != (H, n):
        raise ValueError(f"pk {tuple(pk.shape)} and weights {tuple(weights.shape)} disagree on [H, n]")
    if F != spec_f:
        raise ValueError(f"pk has F={F} features but the spec was made for F={spec_f}")
    if weights.shape[2] != W:
        raise ValueError(f"weights have W={weights.shape[2]} columns but the spec was made for W={W} (d_v + 1)")
    if n == 0:
        raise ValueError("empty context (n = 0)")
    for name, x in (("pk", pk), ("weights", weights)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    # per-feature / per-column extremes (reductions propagate NaN; no full-size temporaries)
    low, high = (r.to(torch.float64) for r in (pk.amin(dim=(0, 1)), pk.amax(dim=(0, 1))))
    w_low, w_high = (r.to(torch.float64) for r in (weights.amin(dim=(0, 1)), weights.amax(dim=(0, 1))))
    for name, extremes in (("pk", (low, high)), ("weights", (w_low, w_high))):
        if not all(bool(torch.isfinite(r).all()) for r in extremes):
            raise ValueError(f"{name} must be finite (NaN/inf found)")
    lo = spec.lo.to(device=pk.device, dtype=torch.float64)
    hi = spec.hi.to(device=pk.device, dtype=torch.float64)
    slack = RANGE_TOLERANCE * (hi - lo)
    bad = (low < lo - slack) | (high > hi + slack)
    if bool(bad.any()):
        f = int(bad.nonzero()[0])
        raise ValueError(
            f"pk feature {f} has values in [{float(low[f])}, {float(high[f])}] outside its public "
            f"range [{float(lo[f])}, {float(hi[f])}]: the noise would not cover its sensitivity"
        )
    weight_bound = spec.sensitivity[:, :, 0].to(torch.float64).amin(dim=1).cpu() / 2  # R_w'
    largest = torch.maximum(w_low.abs(), w_high.abs()).cpu()
    excess = largest > weight_bound * (1 + 1e-12)
    if bool(excess.any()):
        w = int(excess.nonzero()[0])
        raise ValueError(
            f"weights column {w} reaches |w| = {float(largest[w])} above its public bound "
            f"{float(weight_bound[w])} (spec.sensitivity[w, :, 0] / 2): the noise would not "
            f"cover its sensitivity"
        )
    return H, n, F, W


def _check_noise(noise, H: int, W: int, C: int, F: int, N: int) -> None:
    if not isinstance(noise, tuple) or len(noise) != 2:
        raise ValueError("noise must be a (feature_noise, sw_noise) tuple")
    feature, sw = noise
    for name, x, shape in (
        ("feature noise", feature, (H, W, C, F, MOMENTS, 2 * N)),
        ("s_w noise", sw, (H, W, C, 2 * N)),
    ):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            raise ValueError(f"{name} must have the canonical shape {shape}, got {_shape(x)}")
        if not x.is_floating_point() or not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} must be finite floating-point values")
