"""Feature maps P with P(x)^T P(y) ~ exp(beta <x, y>), the polynomial kernel that the DP
cross-attention paper uses but never writes down (it defers P to [AS23]).

* ``TaylorFeatures``: exact Taylor monomials, ``P(x)_alpha = sqrt(beta^|alpha| / alpha!) x^alpha``
  for every multi-index with ``|alpha| <= s``; ``P(x)^T P(y) = T_s(beta <x, y>)`` (the degree-s
  Taylor polynomial of exp) exactly, with ``r = binom(d + s, s)`` coordinates.
* ``RandomFeatures``: positive random features ``exp(w^T x~ - |x~|^2/2)/sqrt(m)``,
  ``x~ = sqrt(beta) x``, ``w ~ N(0, I)`` drawn from a *public* seed; unbiased, no uniform
  relative-error guarantee (experimental).

Every bound a mechanism calibrates from (coordinate ranges, the feature norm) is a function of
public input bounds only: ``coord_bound`` (|x_i| <= R) and ``norm_bound`` (||x||_2 <= rho).
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from scipy import stats

from ..privacy.validation import check_count, check_positive

MAX_FEATURES = 50_000_000


@dataclass(frozen=True)
class InputBounds:
    """Public bounds on one side (keys or queries): ``|x_i| <= coord`` and ``||x||_2 <= norm``."""

    coord: float
    norm: float

    @staticmethod
    def of(coord: float, norm: float | None, dim: int) -> InputBounds:
        """Bounds from a coordinate clip and an optional l2 clip (the box diagonal otherwise)."""
        coord = check_positive(coord, "coordinate bound")
        box_norm = coord * math.sqrt(dim)
        return InputBounds(coord, box_norm if norm is None else min(check_positive(norm, "norm bound"), box_norm))


class FeatureMap(ABC):
    """A map [..., d] -> [..., r] (float64) and the public bounds its mechanisms need."""

    dim_in: int
    dim: int

    @abstractmethod
    def __call__(self, x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``P(x)``: [..., d] -> [..., r] in ``dtype`` (float64 unless a caller opts out)."""

    @abstractmethod
    def coordinate_bounds(self, bounds: InputBounds) -> torch.Tensor:
        """Gamma: [r] float64 with ``|P(x)_f| <= Gamma_f`` for every x within ``bounds``."""

    @abstractmethod
    def norm_bound(self, bounds: InputBounds) -> float:
        """``sup ||P(x)||_2`` over x within ``bounds``."""

    @property
    @abstractmethod
    def nonnegative(self) -> bool:
        """True if ``P(x) >= 0`` for every x in the *nonnegative* orthant (Taylor) or always (PRF)."""


def taylor_degree(logit_bound: float, kernel_error: float, signed: bool) -> int:
    """Smallest Taylor degree s meeting Lemma G.5's relative error ``kernel_error`` (eps_s).

    ``logit_bound`` is T with ``|beta <x, y>| <= T``. Nonnegative inputs (paper setting, t in
    [0, T]): ``Pr[Poisson(T) > s] <= eps_s/(1+eps_s)`` (every Taylor term is positive, so the
    remainder is ``e^t Pr[Poisson(t) > s] <= e^t Pr[Poisson(T) > s]``). Signed inputs (t in
    [-T, T]): ``T^(s+1) e^T / (s+1)! <= eps_s/(1+eps_s)`` (Lagrange remainder), rounded up to an
    even s (even-degree Taylor polynomials of exp are positive).
    """
    check_positive(kernel_error, "kernel_error")
    if not math.isfinite(logit_bound) or logit_bound < 0:
        raise ValueError(f"logit bound T must be finite and >= 0, got {logit_bound!r}")
    target = kernel_error / (1.0 + kernel_error)
    for s in range(200):
        if signed:
            log_tail = (s + 1) * math.log(max(logit_bound, 1e-300)) + logit_bound - math.lgamma(s + 2)
            if log_tail <= math.log(target):
                return s + (s % 2)
        elif stats.poisson.sf(s, logit_bound) <= target:
            return s
    raise ValueError(f"no Taylor degree below 200 reaches kernel error {kernel_error} at T={logit_bound}")


def taylor_kernel_error(logit_bound: float, degree: int, signed: bool) -> float:
    """Achieved relative kernel error eps_s = rho/(1-rho) of degree ``degree`` at T, rho being
    the tail bound of ``taylor_degree`` (what to report when the degree is capped)."""
    if signed:
        rho = math.exp((degree + 1) * math.log(max(logit_bound, 1e-300)) + logit_bound - math.lgamma(degree + 2))
    else:
        rho = float(stats.poisson.sf(degree, logit_bound))
    return math.inf if rho >= 1 else rho / (1.0 - rho)


def taylor_dim(dim_in: int, degree: int) -> int:
    """r = binom(d + s, s)."""
    return math.comb(dim_in + degree, degree)


@dataclass
class TaylorFeatures(FeatureMap):
    """Deduplicated Taylor monomial features of degree <= ``degree`` at logit scale ``beta``.

    Monomials are ordered by degree; each monomial of degree j >= 1 is its ``parent`` (a monomial
    of degree j - 1, by global feature index) times ``x[factor]`` with ``factor`` >= the parent's
    last factor, so each multiset appears once. ``coef: [r]`` holds ``sqrt(beta^|alpha| /
    alpha!)`` and ``order: [r]`` is ``|alpha|``; ``blocks[j]`` is the slice of degree-j features.
    """

    dim_in: int
    degree: int
    beta: float
    parent: torch.Tensor = field(init=False, repr=False)
    factor: torch.Tensor = field(init=False, repr=False)
    coef: torch.Tensor = field(init=False, repr=False)
    order: torch.Tensor = field(init=False, repr=False)
    _cache: dict = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        check_count(self.dim_in, "feature input dim")
        check_positive(self.beta, "beta")
        if not isinstance(self.degree, int) or self.degree < 0:
            raise ValueError(f"Taylor degree must be an integer >= 0, got {self.degree!r}")
        r = taylor_dim(self.dim_in, self.degree)
        if r > MAX_FEATURES:
            raise ValueError(
                f"Taylor features of degree {self.degree} on d={self.dim_in} have r={r:.3g} "
                f"coordinates (> {MAX_FEATURES:.0e}); lower the degree or the logit bound"
            )
        monomials: list[tuple[int, ...]] = [()]
        parents, factors, self.blocks = [-1], [-1], [slice(0, 1)]
        for _ in range(self.degree):
            start = self.blocks[-1].start
            for p in range(start, len(monomials)):
                last = monomials[p][-1] if monomials[p] else 0
                for i in range(last, self.dim_in):
                    monomials.append((*monomials[p], i))
                    parents.append(p)
                    factors.append(i)
            self.blocks.append(slice(self.blocks[-1].stop, len(monomials)))
        self.parent = torch.tensor(parents, dtype=torch.long)
        self.factor = torch.tensor(factors, dtype=torch.long)
        self.order = torch.tensor([len(m) for m in monomials], dtype=torch.long)
        log_fact = [sum(math.lgamma(m.count(i) + 1) for i in set(m)) for m in monomials]
        self.coef = torch.tensor(
            [math.exp(0.5 * (len(m) * math.log(self.beta) - lf)) for m, lf in zip(monomials, log_fact, strict=True)],
            dtype=torch.float64,
        )
        self.dim = r

    def __call__(self, x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Degree by degree: ``mono_j = mono_{j-1}[parent] * x[factor]``, computed feature-major
        (``[r, tokens]``) so each step is a contiguous row gather."""
        rows = x.to(dtype).reshape(-1, self.dim_in).T.contiguous()  # [d, tokens]
        out = rows.new_empty(self.dim, rows.shape[1])
        out[0] = 1.0
        steps, coef = self._on(rows.device, dtype)
        for block, parent, factor in steps:
            torch.mul(out.index_select(0, parent), rows.index_select(0, factor), out=out[block])
        out *= coef
        return out.T.reshape(*x.shape[:-1], self.dim)

    def _on(self, device: torch.device, dtype: torch.dtype) -> tuple[list, torch.Tensor]:
        """The per-degree (slice, parent, factor) index tensors and ``coef: [r, 1]`` on
        ``device`` in ``dtype``, built once per (device, dtype) (queries run every step)."""
        key = (device, dtype)
        if key not in self._cache:
            steps = [(b, self.parent[b].to(device), self.factor[b].to(device)) for b in self.blocks[1:]]
            self._cache[key] = (steps, self.coef.to(device, dtype)[:, None])
        return self._cache[key]

    def tensor_powers(self, x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``[1, x, x (x) x, ...]``: [..., d] -> [..., E] with ``E = sum_j d^j`` (j <= degree), every
        ordered index tuple once and no coefficients. Pairs with ``expand_rows``: the query path
        of degree <= 2, where one broadcast product beats gathering ``r`` monomials."""
        shape, d = x.shape[:-1], self.dim_in
        x = x.to(dtype).reshape(-1, d)  # [t, d]
        out = x.new_empty(x.shape[0], sum(d**j for j in range(self.degree + 1)))
        out[:, 0] = 1.0
        lo = 1
        for j in range(1, self.degree + 1):  # block j = block j-1 (x) x, written in place
            block = out[:, lo : lo + d**j].view(-1, d ** (j - 1), d)
            previous = out[:, lo - d ** (j - 1) : lo]
            torch.mul(previous[:, :, None], x[:, None, :], out=block)
            lo += d**j
        return out.view(*shape, -1)

    def expand_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows: [H, r, W]`` (a release, indexed by monomial) -> ``[H, E, W]`` with
        ``tensor_powers(x) @ out == self(x) @ rows`` exactly: the row of ordered tuple ``t`` with
        multiset ``alpha`` is ``coef_alpha rows_alpha / (|alpha|! / alpha!)``. Post-processing."""
        tuples = self._tuple_monomials()  # [E]
        multiplicity = torch.bincount(tuples, minlength=self.dim).to(torch.float64)  # |alpha|!/alpha!
        weight = (self.coef / multiplicity).to(rows)
        return (rows * weight[:, None]).index_select(1, tuples.to(rows.device))

    def _tuple_monomials(self) -> torch.Tensor:
        """``[E]``: the monomial of every ordered index tuple, in ``tensor_powers`` order."""
        factors = [()]  # factors[f]: monomial f's sorted factor tuple
        for f in range(1, self.dim):
            factors.append((*factors[int(self.parent[f])], int(self.factor[f])))
        index = {t: f for f, t in enumerate(factors)}
        ordered = (t for j in range(self.degree + 1) for t in itertools.product(range(self.dim_in), repeat=j))
        return torch.tensor([index[tuple(sorted(t))] for t in ordered], dtype=torch.long)

    def coordinate_bounds(self, bounds: InputBounds) -> torch.Tensor:
        """Gamma_alpha = coef_alpha * R^|alpha| (tight per-coordinate range; the paper's single
        Gamma_{R,s} bounds every coordinate, loosely)."""
        return self.coef * torch.pow(torch.tensor(bounds.coord, dtype=torch.float64), self.order)

    def norm_bound(self, bounds: InputBounds) -> float:
        """sqrt(T_s(beta rho^2)): ||P(x)||^2 = T_s(beta ||x||^2), increasing in ||x||."""
        t = self.beta * bounds.norm**2
        return math.sqrt(sum(t**j / math.factorial(j) for j in range(self.degree + 1)))

    @property
    def nonnegative(self) -> bool:
        return True

    def paper_global_bound(self, coord: float) -> float:
        """The paper's single range Gamma_{R,s} = max_{1<=j<=s} R^j / sqrt(j!) (Def. G.3)."""
        return max([coord**j / math.sqrt(math.factorial(j)) for j in range(1, self.degree + 1)] + [1.0])


@dataclass
class RandomFeatures(FeatureMap):
    """Positive random features (Performer FAVOR+), ``m`` of them, from a public ``seed``.

    ``omega: [m, d]`` ~ N(0, I); ``P(x)_i = exp(omega_i^T x~ - ||x~||^2/2) / sqrt(m)`` with
    ``x~ = sqrt(beta) x``. ``E[P(x)^T P(y)] = exp(beta <x, y>)``.
    """

    dim_in: int
    num_features: int
    beta: float
    seed: int = 0
    omega: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_count(self.dim_in, "feature input dim")
        check_count(self.num_features, "num_random_features")
        check_positive(self.beta, "beta")
        generator = torch.Generator().manual_seed(self.seed)
        self.omega = torch.randn(self.num_features, self.dim_in, generator=generator, dtype=torch.float64)
        self.dim = self.num_features

    def __call__(self, x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        x_scaled = math.sqrt(self.beta) * x.to(dtype)
        logits = x_scaled @ self.omega.to(x_scaled).T - 0.5 * (x_scaled**2).sum(-1, keepdim=True)
        return torch.exp(logits) / math.sqrt(self.num_features)

    def coordinate_bounds(self, bounds: InputBounds) -> torch.Tensor:
        """max over ||x~|| = t <= rho~ of exp(|w| t - t^2/2) / sqrt(m)."""
        rho = math.sqrt(self.beta) * bounds.norm
        w = self.omega.norm(dim=-1)
        t = torch.clamp(w, max=rho)
        return torch.exp(w * t - 0.5 * t**2) / math.sqrt(self.num_features)

    def norm_bound(self, bounds: InputBounds) -> float:
        return float(self.coordinate_bounds(bounds).norm())

    @property
    def nonnegative(self) -> bool:
        return True
