"""Mode A ``ref``: Algorithms 1-7 of the DP cross-attention paper (Ke et al.), literally.

Object-per-tree, float64, CPU, Python loops: small sizes only. This module is the test oracle
for the vectorised implementation, so it follows the paper's pseudo-code line by line and takes
no shortcut the paper does not take (all three moment trees of every DPTreeDistance are built,
including the s_w structure's never-read q = 0, 1 trees).

Conventions (where the paper is silent or ambiguous):
* 1-based heap nodes: node 1 is the root, node k has children 2k, 2k+1, leaves are N..2N-1;
  N = number of leaves (a power of 2), L = log2 N layers below the root.
* Binning: Alg. 4's floor bins, clamped so that y = hi (outside the paper's half-open bins)
  lands in the last one; on a range [lo, hi] (lo < 0 for signed inputs), layer i (2^i nodes)
  puts y into node ``j = clamp(floor((y - lo) 2^i / (hi - lo)) + 1, 1, 2^i)``; data use layer L
  (the leaves).
* The root's noisy value is never read and never kept (Alg. 2 noises it, but the accounting
  over L nodes per leaf holds only if it is not released): ``DPTree.nodes[0:2]`` are NaN.
* Noise is drawn once, at INIT (truncated Laplace, ``truncated_laplace_mechanism``); queries are
  post-processing. Injected noise follows the canonical layout of ``tree_spec``: position k of a
  tree's ``[2N]`` noise vector is node k's noise (positions 0 and 1 are ignored).
* No raw data (x, w, P(K), V, exact node sums) is kept after INIT (Algs. 3, 4, 6 list them as
  members, but they are not DP).

Classes: ``DPTree`` (Alg. 2), ``DPTreeDistance`` (Alg. 4/5), ``DPTreeHighDim`` (Alg. 6),
``DPTreeSoftmax`` (Alg. 3), ``DPTreeSoftmaxAdaptive`` (Alg. 7), ``DPCrossAttentionReference``
(Alg. 1, one KV head). ``ReferenceMode`` is the ``mode="reference"`` entry of the release-mode
registry (``modes``): the tree mode's mechanism, built with one ``DPCrossAttentionReference`` per
KV head (``PerHeadReference``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

from ..privacy.keyed_noise import fresh_generator
from ..privacy.mechanisms import Mechanism, truncated_laplace_mechanism
from ..privacy.validation import check_delta, check_epsilon, check_positive
from .budget import TreeBudget, TreeParams
from .tree import TreeMode
from .tree_spec import TreeSpec

if TYPE_CHECKING:
    from .base import ReleaseContext

RANGE_SLACK = 1e-9  # relative slack of the data-range check (feature maps round by a few ulps)


def bin_index(y: float, lo: float, hi: float, size: int) -> int:
    """1-based node of the layer with ``size`` (a power of 2) nodes containing y (Alg. 2 l. 21).

    ``min(floor((y - lo) size / (hi - lo)) + 1, size)``, clamped to >= 1. ``size`` is a power of
    2, so ``(y - lo) * size`` is exact and every layer bins the same rounded ``(y - lo)/(hi - lo)``:
    a layer's node is always the ancestor of the leaf the data use."""
    j = math.floor((y - lo) * size / (hi - lo)) + 1
    return max(1, min(j, size))


@functools.lru_cache(maxsize=4096)
def _node_mechanism(sensitivity: float, epsilon: float, delta: float) -> Mechanism:
    """TLap(Delta, eps, delta) of one node (a frozen, pure value: cached across trees)."""
    return truncated_laplace_mechanism(sensitivity, epsilon, delta)


def _generator(generator: torch.Generator | None) -> torch.Generator:
    """The caller's generator, or a fresh CPU one seeded from 256 bits of OS entropy."""
    return generator if generator is not None else fresh_generator()


def _levels(leaves: int) -> int:
    if not isinstance(leaves, int) or leaves < 2 or leaves & (leaves - 1):
        raise ValueError(f"the number of leaves must be a power of 2 >= 2, got {leaves!r}")
    return leaves.bit_length() - 1


def _check_range(lo: float, hi: float, name: str) -> tuple[float, float]:
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"{name} range must satisfy lo < hi (finite), got [{lo}, {hi}]")
    return lo, hi


def _check_noise(noise: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    noise = torch.as_tensor(noise, dtype=torch.float64)
    if tuple(noise.shape) != shape:
        raise ValueError(f"{name} noise must have shape {shape}, got {tuple(noise.shape)}")
    return noise


class DPTree:
    """Algorithm 2: a binary segment tree over N bins, every node (except the root) noisy.

    INIT(a [N] bin sums, Delta, eps, delta): node k holds ``sum of a over k's leaves + z_k``,
    ``z_k ~ TLap(Delta, eps/L, delta/L)`` i.i.d. Guarantee (Thm B.1, Lemma B.6; they also hold
    under replace-one neighbours): (eps, delta)-DP for neighbouring bin vectors that differ in one
    leaf by at most Delta, or (a replaced datum changing bins) in two leaves by at most Delta/2
    each: every leaf lies on L released nodes. Units: node values are in the units of ``a``.
    Attributes: ``leaves`` N, ``levels`` L, ``lo``/``hi`` the public range (Alg. 2's QUERY uses it
    without receiving it), ``mechanism`` the per-node TLap law; ``nodes`` is a [2N] float64 copy,
    positions 0 and 1 (unused slot, root) are NaN.

    QUERY(y) reads exactly L nodes (one sibling per layer) and returns ``(c_left, c_right)``,
    noisy sums of the bins strictly left / strictly right of y's bin; y's own bin is in neither.
    Error: ``c_left + c_right`` minus its exact value is a sum of L i.i.d. node noises, so it has
    variance ``L * mechanism.variance`` and is at most ``L * mechanism.noise.bound`` in absolute
    value, deterministically.
    """

    def __init__(
        self,
        leaves: torch.Tensor | Sequence[float],
        sensitivity: float,
        epsilon: float,
        delta: float,
        lo: float,
        hi: float,
        node_noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if isinstance(leaves, torch.Tensor):
            values = leaves.to(torch.float64).reshape(-1).tolist()
        else:
            values = [float(v) for v in leaves]
        self.leaves = len(values)
        self.levels = _levels(self.leaves)
        self.lo, self.hi = _check_range(lo, hi, "DPTree")
        check_epsilon(epsilon)
        check_delta(delta)
        self.mechanism: Mechanism = _node_mechanism(
            float(sensitivity), epsilon / self.levels, delta / self.levels
        )
        self._nodes = self._noisy_nodes(self._exact_nodes(values), node_noise, generator)
        self.reads = 0
        self.total_reads = 0
        self.last_read: tuple[int, ...] = ()

    def _exact_nodes(self, values: list[float]) -> list[float]:
        """b[N..2N-1] = a (line 6); b[k] = b[2k] + b[2k+1] for k = N-1..1 (lines 10-13)."""
        n = self.leaves
        exact = [0.0] * (2 * n)
        exact[n:] = values
        for k in range(n - 1, 0, -1):
            exact[k] = exact[2 * k] + exact[2 * k + 1]
        return exact

    def _noisy_nodes(
        self, exact: list[float], node_noise: torch.Tensor | None, generator: torch.Generator | None
    ) -> list[float]:
        """c[k] = b[k] + z_k (lines 8, 14); the root (and slot 0) are dropped, not released."""
        shape = (2 * self.leaves,)
        if node_noise is None:
            noise = self.mechanism.sample(shape, _generator(generator)).cpu()
        else:
            noise = _check_noise(node_noise, shape, "node")
        nodes = [b + z for b, z in zip(exact, noise.tolist(), strict=True)]
        nodes[0] = nodes[1] = math.nan
        return nodes

    @property
    def nodes(self) -> torch.Tensor:
        """[2N] float64 noisy node values c[k] at position k; positions 0 and 1 are NaN."""
        return torch.tensor(self._nodes, dtype=torch.float64)

    def query(self, y: float) -> tuple[float, float]:
        """(c_left, c_right) for y (lines 18-29); reads exactly L nodes, never the root."""
        c_left, c_right = 0.0, 0.0
        read = []
        for i in range(1, self.levels + 1):  # layer i: heap indices 2^i .. 2^{i+1}-1
            j = bin_index(float(y), self.lo, self.hi, 1 << i)
            if j % 2 == 0:  # y's node is a right child: add its LEFT sibling
                k = (1 << i) + j - 2
                c_left += self._nodes[k]
            else:  # y's node is a left child: add its RIGHT sibling
                k = (1 << i) + j
                c_right += self._nodes[k]
            read.append(k)
        self.last_read = tuple(read)
        self.reads = len(read)
        self.total_reads += len(read)
        return c_left, c_right


class DPTreeDistance:
    """Algorithms 4 and 5: 1-D weighted l_p^p distance ``sum_i w_i |y - x_i|^p``.

    INIT bins each x_i (floor rule on [lo, hi], clamped to [1, N]) and accumulates the EXACT
    moments ``w_i x_i^q`` (q = 0..p) into p+1 DPTrees, tree q with sensitivity
    ``Delta_q = 2 R_w Rng^q`` (Rng = max(|lo|, |hi|)) and budget (eps/(p+1), delta/(p+1)).
    Guarantee (Thm D.1): (eps, delta)-DP for replace-one neighbours of (x_i, w_i) with
    x_i in [lo, hi] and |w_i| <= R_w. x and w are not kept.

    QUERY(y) (Alg. 5, Lemma C.1): ``sum_q binom(p,q) y^(p-q) ((-1)^(p-q) cr_q + (-1)^q cl_q)``.
    Noise-free it equals ``sum_{i: bin(x_i) != bin(y)} w_i |x_i - y|^p`` (the own bin is excluded).
    """

    def __init__(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        p: int,
        epsilon: float,
        delta: float,
        lo: float,
        hi: float,
        weight_bound: float,
        leaves: int,
        noise: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if not isinstance(p, int) or p < 0:
            raise ValueError(f"p must be an integer >= 0, got {p!r}")
        self.p = p
        self.lo, self.hi = _check_range(lo, hi, "DPTreeDistance")
        self.range = max(abs(self.lo), abs(self.hi))
        self.weight_bound = check_positive(weight_bound, "weight_bound")
        levels = _levels(leaves)
        moments = self._moments(x, w, leaves)
        per_tree = self._tree_noise(noise, 2 * leaves)
        gen = _generator(generator) if any(z is None for z in per_tree) else None
        self.sensitivities = [2.0 * self.weight_bound * self.range**q for q in range(p + 1)]
        self.trees = [
            DPTree(
                moments[q],
                self.sensitivities[q],
                epsilon / (p + 1),
                delta / (p + 1),
                self.lo,
                self.hi,
                per_tree[q],
                gen,
            )
            for q in range(p + 1)
        ]
        assert all(tree.levels == levels for tree in self.trees)

    def _moments(self, x: torch.Tensor, w: torch.Tensor, leaves: int) -> list[list[float]]:
        """a[j, q] += w_i x_i^q for j = bin(x_i) (Alg. 4 lines 8-13); returns a[:, q] per q."""
        xs = torch.as_tensor(x, dtype=torch.float64).reshape(-1).tolist()
        ws = torch.as_tensor(w, dtype=torch.float64).reshape(-1).tolist()
        if len(xs) != len(ws):
            raise ValueError(f"x and w must have the same length, got {len(xs)} and {len(ws)}")
        slack = RANGE_SLACK * (self.hi - self.lo)
        a = [[0.0] * leaves for _ in range(self.p + 1)]
        for xi, wi in zip(xs, ws, strict=True):
            if not (self.lo - slack <= xi <= self.hi + slack):
                raise ValueError(f"datum {xi} outside the public range [{self.lo}, {self.hi}]")
            if not abs(wi) <= self.weight_bound:
                raise ValueError(f"weight {wi} outside [-R_w, R_w], R_w = {self.weight_bound}")
            j = bin_index(xi, self.lo, self.hi, leaves)
            for q in range(self.p + 1):
                a[q][j - 1] += wi * xi**q  # EXACT x^q (line 12), not the bin centre
        return a

    def _tree_noise(
        self, noise: torch.Tensor | Sequence[torch.Tensor | None] | None, nodes: int
    ) -> list[torch.Tensor | None]:
        if noise is None:
            return [None] * (self.p + 1)
        if isinstance(noise, torch.Tensor):
            noise = _check_noise(noise, (self.p + 1, nodes), "DPTreeDistance")
        elif len(noise) != self.p + 1:
            raise ValueError(
                f"DPTreeDistance noise needs p+1 = {self.p + 1} entries, got {len(noise)}"
            )
        return [None if z is None else _check_noise(z, (nodes,), "DPTree") for z in noise]

    def query(self, y: float) -> float:
        """Alg. 5: combine the p+1 trees' (cl_q, cr_q) at y by the Lemma C.1 identity."""
        y = float(y)
        total = 0.0
        for q, tree in enumerate(self.trees):
            c_left, c_right = tree.query(y)
            total += (
                math.comb(self.p, q)
                * y ** (self.p - q)
                * ((-1) ** (self.p - q) * c_right + (-1) ** q * c_left)
            )
        return total


class DPTreeHighDim:
    """Algorithm 6: weighted ``sum_i w_i ||y - x_i||_p^p`` over d dimensions (Eq. (3)).

    One DPTreeDistance per input dimension i with ``eps_i = c eps / sqrt(d ln(1/delta'))`` and
    ``delta_i = delta/d`` (line 11). Guarantee (Lemma E.1): (O(eps), delta + delta')-DP by
    advanced composition (needs eps = O(ln(1/delta')) and a small c). Not on the softmax path.
    """

    def __init__(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        p: int,
        epsilon: float,
        delta: float,
        delta_prime: float,
        c: float,
        lo: float | torch.Tensor,
        hi: float | torch.Tensor,
        weight_bound: float,
        leaves: int,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        x = torch.as_tensor(x, dtype=torch.float64)
        d = x.shape[1]
        check_delta(delta_prime, "delta_prime")
        check_positive(c, "c")
        self.epsilon_dim = c * epsilon / math.sqrt(d * math.log(1.0 / delta_prime))
        self.delta_dim = delta / d
        lo_d = torch.as_tensor(lo, dtype=torch.float64).expand(d)
        hi_d = torch.as_tensor(hi, dtype=torch.float64).expand(d)
        if noise is not None:
            noise = _check_noise(noise, (d, p + 1, 2 * leaves), "DPTreeHighDim")
        gen = _generator(generator) if noise is None else None
        self.dims = [
            DPTreeDistance(
                x[:, i],
                w,
                p,
                self.epsilon_dim,
                self.delta_dim,
                float(lo_d[i]),
                float(hi_d[i]),
                weight_bound,
                leaves,
                None if noise is None else noise[i],
                gen,
            )
            for i in range(d)
        ]

    def query(self, y: torch.Tensor) -> float:
        """sum_i D_i.DISTANCEQUERY(y_i)."""
        ys = torch.as_tensor(y, dtype=torch.float64).reshape(-1).tolist()
        return sum(dim.query(yi) for dim, yi in zip(self.dims, ys, strict=True))


class DPTreeSoftmax:
    """Algorithm 3: one weighted softmax query ``sum_j w_j P(x_j)^T P(y)`` via Eq. (2).

    Takes the key features ``U = P(K) [n, F]`` (computed by the caller with a public feature
    map) and weights ``w [n]``. Per feature f: a p = 2 DPTreeDistance over [lo_f, hi_f] with
    ``eps_f = c eps / (3 sqrt(F ln(2/delta')))``, ``delta_f = delta/(3F)`` (line 15, whose printed
    "ce" is read as c * eps, as in Alg. 6 line 11). The s_w structure: a p = 2 DPTreeDistance over
    data 1_n on [0, sw_hi] with (eps/3, delta/3).
    ``P_wx = sum_f D_f(0)`` and ``s_w = D_0(0)`` are computed at INIT; U and w are not kept.
    Guarantee (Thm 5.2/G.7): (eps, delta + delta')-DP (spends ~ (2 eps/3, 2 delta/3 + delta'/2)).

    QUERY(v = P(y)) = ``1/2 (P_wx + s_w ||v||^2 - sum_f D_f(v_f))`` (line 28). Only the s_w
    structure's q = 2 tree is ever read. Injected ``noise = (feature [F, 3, 2N], sw [2N])``:
    ``sw`` is the s_w q = 2 tree's node noise; its q = 0, 1 trees then draw their own noise.
    """

    def __init__(
        self,
        u: torch.Tensor,
        w: torch.Tensor,
        epsilon: float,
        delta: float,
        delta_prime: float,
        c: float,
        lo: torch.Tensor,
        hi: torch.Tensor,
        weight_bound: float,
        sw_hi: float,
        leaves: int,
        noise: tuple[torch.Tensor, torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        u = torch.as_tensor(u, dtype=torch.float64)
        w = torch.as_tensor(w, dtype=torch.float64)
        n, features = u.shape
        check_epsilon(epsilon)
        check_delta(delta_prime, "delta_prime")
        check_positive(c, "c")
        lo = torch.as_tensor(lo, dtype=torch.float64).expand(features)
        hi = torch.as_tensor(hi, dtype=torch.float64).expand(features)
        self.features = features
        self.epsilon_f = c * epsilon / (3.0 * math.sqrt(features * math.log(2.0 / delta_prime)))
        self.delta_f = delta / (3.0 * features)
        feature_noise, sw_noise = self._split_noise(noise, features, leaves)
        gen = _generator(generator)  # s_w's unread q = 0, 1 trees always draw their own noise
        self.distances = [
            DPTreeDistance(
                u[:, f],
                w,
                2,
                self.epsilon_f,
                self.delta_f,
                float(lo[f]),
                float(hi[f]),
                weight_bound,
                leaves,
                None if feature_noise is None else feature_noise[f],
                gen,
            )
            for f in range(features)
        ]
        self.p_wx = sum(distance.query(0.0) for distance in self.distances)  # line 16
        self.sw = DPTreeDistance(  # line 18: data 1_n
            torch.ones(n, dtype=torch.float64),
            w,
            2,
            epsilon / 3.0,
            delta / 3.0,
            0.0,
            sw_hi,
            weight_bound,
            leaves,
            None if sw_noise is None else [None, None, sw_noise],
            gen,
        )
        self.s_w = self.sw.query(0.0)  # line 19

    @staticmethod
    def _split_noise(
        noise: tuple[torch.Tensor, torch.Tensor] | None, features: int, leaves: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if noise is None:
            return None, None
        feature_noise, sw_noise = noise
        return (
            _check_noise(feature_noise, (features, 3, 2 * leaves), "DPTreeSoftmax feature"),
            _check_noise(sw_noise, (2 * leaves,), "DPTreeSoftmax s_w"),
        )

    def query(self, v: torch.Tensor) -> float:
        """1/2 (P_wx + s_w ||v||^2 - Value), Value = sum_f D_f(v_f) (lines 21-30)."""
        vs = torch.as_tensor(v, dtype=torch.float64).reshape(-1).tolist()
        if len(vs) != self.features:
            raise ValueError(f"query features must have length {self.features}, got {len(vs)}")
        value = sum(distance.query(vf) for distance, vf in zip(self.distances, vs, strict=True))
        norm2 = sum(vf * vf for vf in vs)
        return 0.5 * (self.p_wx + self.s_w * norm2 - value)


class DPTreeSoftmaxAdaptive:
    """Algorithm 7: the median of l independent DPTreeSoftmax copies at (eps/l, delta/l, delta'/l).

    Guarantee (Thm 5.3/G.10): (eps, delta + delta')-DP by basic composition over the copies; the
    median makes the accuracy bound hold for all queries at once w.p. 1 - p_f (theory l).
    ``noise = (feature [C, F, 3, 2N], sw [C, 2N])`` injects every copy's noise. l must be odd.
    """

    def __init__(
        self,
        u: torch.Tensor,
        w: torch.Tensor,
        epsilon: float,
        delta: float,
        delta_prime: float,
        c: float,
        lo: torch.Tensor,
        hi: torch.Tensor,
        weight_bound: float,
        sw_hi: float,
        leaves: int,
        copies: int,
        noise: tuple[torch.Tensor, torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if not isinstance(copies, int) or copies < 1 or copies % 2 == 0:
            raise ValueError(f"copies must be an odd integer >= 1 (the answer is the median of the copies), got {copies!r}")
        if noise is not None and (len(noise[0]) != copies or len(noise[1]) != copies):
            raise ValueError(f"injected noise must have {copies} copies on its leading axis")
        gen = _generator(generator)
        self.copies = [
            DPTreeSoftmax(
                u,
                w,
                epsilon / copies,
                delta / copies,
                delta_prime / copies,
                c,
                lo,
                hi,
                weight_bound,
                sw_hi,
                leaves,
                None if noise is None else (noise[0][i], noise[1][i]),
                gen,
            )
            for i in range(copies)
        ]

    def copy_answers(self, v: torch.Tensor) -> torch.Tensor:
        """[l] float64: every copy's DISTANCEQUERY(v)."""
        return torch.tensor([copy.query(v) for copy in self.copies], dtype=torch.float64)

    def query(self, v: torch.Tensor) -> float:
        """median_i D_i.DISTANCEQUERY(v) (lines 11-17)."""
        answers = sorted(copy.query(v) for copy in self.copies)
        return answers[len(answers) // 2]


class DPCrossAttentionReference:
    """Algorithm 1 for ONE KV head: ``Attn_i = (A V)_i / D_ii`` from W = d_v + 1 weighted
    softmax structures (columns 0..d_v-1: value columns, weight bound R_w; column d_v: all-ones
    weights, the denominator, weight bound ``ones_bound``).

    Every column is a DPTreeSoftmaxAdaptive at (eps/A, delta/A, delta'/A), A = d_v + 1
    (``output_level='row'``, Remark 4.2: the whole output row is (eps, delta + delta')-DP) or
    A = 2 (``'entry'``, Thm 4.1: each output entry is). ``pk = P(K) [n, F]`` and ``values
    [n, d_v]`` (already clipped to [-R_w, R_w]) are not kept.
    ``noise = (feature [W, C, F, 3, 2N], sw [W, C, 2N])``: the canonical layout of one head.
    """

    def __init__(
        self,
        pk: torch.Tensor,
        values: torch.Tensor,
        epsilon: float,
        delta: float,
        delta_prime: float,
        c: float,
        copies: int,
        output_level: Literal["row", "entry"],
        lo: torch.Tensor,
        hi: torch.Tensor,
        value_bound: float,
        ones_bound: float,
        sw_hi: float,
        leaves: int,
        noise: tuple[torch.Tensor, torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        pk = torch.as_tensor(pk, dtype=torch.float64)
        values = torch.as_tensor(values, dtype=torch.float64)
        n, value_dim = values.shape
        if pk.shape[0] != n:
            raise ValueError(f"P(K) has {pk.shape[0]} rows but V has {n}")
        if output_level == "row":
            parts = value_dim + 1
        elif output_level == "entry":
            parts = 2
        else:
            raise ValueError(f"output_level must be 'row' or 'entry', got {output_level!r}")
        self.value_dim = value_dim
        self.parts = parts
        weights = torch.cat([values, torch.ones(n, 1, dtype=torch.float64)], dim=1)  # [n, W]
        bounds = [float(value_bound)] * value_dim + [float(ones_bound)]
        if noise is not None and (len(noise[0]) != value_dim + 1 or len(noise[1]) != value_dim + 1):
            raise ValueError(
                f"injected noise must have W = {value_dim + 1} columns on its leading axis"
            )
        gen = _generator(generator)
        self.columns = [
            DPTreeSoftmaxAdaptive(
                pk,
                weights[:, k],
                epsilon / parts,
                delta / parts,
                delta_prime / parts,
                c,
                lo,
                hi,
                bounds[k],
                sw_hi,
                leaves,
                copies,
                None if noise is None else (noise[0][k], noise[1][k]),
                gen,
            )
            for k in range(value_dim + 1)
        ]

    def answer(self, pq: torch.Tensor) -> torch.Tensor:
        """[m, W] float64: each column's median answer (numerators, then the denominator)."""
        pq = torch.as_tensor(pq, dtype=torch.float64)
        return torch.tensor(
            [[column.query(v) for column in self.columns] for v in pq], dtype=torch.float64
        ).reshape(pq.shape[0], len(self.columns))

    def query(self, pq: torch.Tensor) -> torch.Tensor:
        """[m, d_v]: num_k / den (Alg. 1 lines 13-15); literal: Alg. 1 divides blindly, so no
        denominator or output clamp."""
        answers = self.answer(pq)
        return answers[:, : self.value_dim] / answers[:, self.value_dim :]


def reference_arguments(spec: TreeSpec, budget: TreeBudget, params: TreeParams, value_bound: float) -> dict:
    """The literal Alg. 1 arguments of ``DPCrossAttentionReference`` (everything but the data,
    noise and generator) for the head that ``spec``/``budget``/``params`` describe; the reference
    redoes the budget splits itself from these."""
    return {
        "epsilon": budget.head.epsilon,
        "delta": budget.head.delta,
        "delta_prime": params.delta_prime,
        "c": budget.c,
        "copies": params.copies,
        "output_level": params.output_level,
        "lo": spec.lo,
        "hi": spec.hi,
        "value_bound": value_bound,
        "ones_bound": 1.0 if params.ones_sensitivity == "unit" else value_bound,
        "sw_hi": spec.sw_hi,
        "leaves": spec.leaves,
    }


class PerHeadReference:
    """The reference mode's release: one literal Alg. 1 object per KV head, answered head by head."""

    def __init__(self, heads: list[DPCrossAttentionReference]) -> None:
        self.heads = heads

    @staticmethod
    def stack(parts: Sequence[PerHeadReference]) -> PerHeadReference:
        return PerHeadReference([head for part in parts for head in part.heads])

    def answer(self, pq: torch.Tensor) -> torch.Tensor:
        """``pq: [H, m, F]`` -> ``[H, m, W]`` float64."""
        return torch.stack([head.answer(pq[h]) for h, head in enumerate(self.heads)])

    @property
    def nbytes(self) -> int:
        return 0


class ReferenceMode(TreeMode):
    """``mode="reference"`` (``ReleaseMode``): the tree mode's spec, accounting and memory cap,
    released by the literal oracle (one ``DPCrossAttentionReference`` per KV head)."""

    def build(
        self, layer: ReleaseContext, pk: torch.Tensor, weights: torch.Tensor, generator: torch.Generator
    ) -> PerHeadReference:
        n = pk.shape[1]
        params, value_bound = layer.params.tree, layer.mapping.value_bound
        arguments = reference_arguments(layer.tree_spec(n), layer.tree_budget(n), params, value_bound)
        return PerHeadReference([
            DPCrossAttentionReference(pk[h], weights[h, :, :-1], **arguments, generator=generator)
            for h in range(pk.shape[0])
        ])

    def stack(self, releases: Sequence[PerHeadReference]) -> PerHeadReference:
        return PerHeadReference.stack(releases)
