"""Token mechanisms for prompt privatization, each with its honest per-token guarantee.

The privacy unit is one token: a mechanism is (epsilon, delta)-DP per token when, for ANY two
input-domain tokens w, w' (word-level DP, the TrLaplace paper's Def 2: any token against any
other, not metric DP), its output laws satisfy the DP inequality.
All mechanisms act on the clipped public table of an ``EmbeddingTable``, draw fresh float64
noise for every token (never one vector shared across tokens), and are built by
``token_mechanism(name, table, epsilon, delta)``:

* ``trlap_corrected`` (default): TrLaplace with the corrected calibration
  (``A = (D1/eps) ln(1 + (D1/Dinf) (e^{eps Dinf/D1} - 1) / (2 delta))``, ``privacy.trlaplace``)
  and the table's exact l1/linf sensitivities; (epsilon, delta)-DP.
* ``trlap_paper`` / ``trlap_repro``: Thm 3 as printed / as in the authors' code (its d_eff switch
  and delta^(1/d) = 1/4, applied to the table's C; noise is still fresh per token). NOT DP at the
  claimed delta (its proof misses that one coordinate leaving the shared support suffices; the
  true delta is up to ~1): a loud warning is emitted and the *true* per-token delta over the
  input domain is recorded, never 4^-d. Reproduction only.
* ``laplace``: Laplace of l1 sensitivity; pure epsilon-DP.
* ``gaussian_analytic``: analytic Gaussian (Balle & Wang) of l2 sensitivity = exact diameter.
* ``expmech``: exponential mechanism over the candidates, ``Pr[c | w] ~ exp(-eps ||x_w - x_c||_2 /
  (2 Delta_2))`` sampled with Gumbel-max; pure epsilon-DP (not in the TrLaplace paper: it is
  the option with both an honest guarantee and usable utility in high d).
* ``mahalanobis`` / ``cmp``: metric DP (Xu et al. 2020 / Feyisetan et al. 2020; ``cmp`` is
  lambda = 0). ``epsilon`` is the METRIC epsilon per unit distance; over the input domain it
  converts to pure (epsilon * Delta_2)-DP per token, Delta_2 the diameter in the mechanism's metric.

The additive mechanisms release ``x_w + noise``, which the privatizer projects onto the nearest
candidate (post-processing); ``expmech`` samples a candidate directly.

What does not depend on epsilon (the Mahalanobis square root of the covariance and its metric
diameter, the candidates' rows of ``expmech``) is computed once per table and shared by every
mechanism built for it (``table_constant``): a request picking a new epsilon costs no
eigendecomposition and no O(V^2 d) diameter.
"""

from __future__ import annotations

import math
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from dp_accounting import dp_event

from ..kernels.nearest_reference import squared_distance_scores
from ..privacy.events import EpsilonDeltaDpEvent
from ..privacy.mechanisms import (
    Mechanism,
    gaussian_mechanism,
    laplace_mechanism,
    warn_not_private,
)
from ..privacy.trlaplace import trlaplace_mechanism, true_delta
from ..privacy.validation import check_count, check_delta, check_epsilon
from .table import EmbeddingTable, l2_diameter

MECHANISMS: tuple[str, ...] = (
    "trlap_corrected",
    "trlap_paper",
    "trlap_repro",
    "laplace",
    "gaussian_analytic",
    "expmech",
    "mahalanobis",
    "cmp",
)
NEEDS_DELTA = ("trlap_corrected", "gaussian_analytic")
REPRODUCTION = {"trlap_paper": "paper", "trlap_repro": "repo"}
EXACT_DELTA_TERMS = 1 << 28  # V^2 d pair-coordinate terms allowed for the exact true delta
BLOCK_ELEMENTS = 1 << 22  # float64 entries of one working block (32 MiB)


@dataclass(frozen=True)
class TokenGuarantee:
    """The honest per-token privacy statement of a token mechanism.

    ``epsilon``/``delta``: canonical DP parameters per token, any token <-> any token of the
    input domain (for metric-DP mechanisms the converted epsilon; for reproduction modes the
    TRUE delta, never the claimed one). ``valid``: ``(epsilon, delta)`` is a proven guarantee.
    ``metric_epsilon``: epsilon per unit distance for metric-DP mechanisms, else None.
    Exposes the attributes ``privacy.PrivacyLedger`` reads (name, epsilon, delta, valid,
    dp_event, statement()), so token releases are composed by the privacy core's accountant.
    """

    name: str
    epsilon: float
    delta: float
    valid: bool
    dp_event: dp_event.DpEvent
    description: str
    metric_epsilon: float | None = None

    @staticmethod
    def pure(name: str, epsilon: float, description: str, metric_epsilon: float | None = None) -> TokenGuarantee:
        """A proven pure ``(epsilon, 0)``-DP per-token guarantee."""
        return TokenGuarantee(name, epsilon, 0.0, True, EpsilonDeltaDpEvent(epsilon, 0.0), description, metric_epsilon)

    def statement(self) -> str:
        """One line: the per-token guarantee and its unit."""
        return self.description


class TokenMechanism(ABC):
    """A per-token mechanism calibrated for ``table``; ``guarantee`` is its statement."""

    table: EmbeddingTable
    guarantee: TokenGuarantee

    @property
    def name(self) -> str:
        """The mechanism's name (one of ``MECHANISMS``)."""
        return self.guarantee.name


class AdditiveTokenMechanism(TokenMechanism):
    """Releases ``x_w + z`` with fresh i.i.d. noise ``z`` per token (then projected)."""

    @abstractmethod
    def sample_noise(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """``count`` independent noise vectors ``[count, d]``, float64, on ``generator.device``."""

    def perturb(self, rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``rows [n, d]`` (clipped embeddings) plus fresh noise per row: ``[n, d]`` float64."""
        noise = self.sample_noise(rows.shape[0], generator).to(rows.device)
        return rows.to(torch.float64) + noise


@dataclass(frozen=True, eq=False)
class CoordinateNoiseMechanism(AdditiveTokenMechanism):
    """i.i.d. per-coordinate noise of a privacy-core ``Mechanism`` (Laplace, TrLaplace, Gaussian)."""

    table: EmbeddingTable
    guarantee: TokenGuarantee
    noise: Mechanism

    def sample_noise(self, count: int, generator: torch.Generator) -> torch.Tensor:
        return self.noise.sample((count, self.table.dim), generator)


@dataclass(frozen=True, eq=False)
class MahalanobisMechanism(AdditiveTokenMechanism):
    """Metric-DP noise ``z = R * S u``: ``R ~ Gamma(d, 1/metric_epsilon)``, ``u`` uniform on the
    unit sphere, ``S = Sigma_lambda^(1/2)`` ``[d, d]`` (identity for CMP). Density of z is
    proportional to ``exp(-metric_epsilon * ||S^-1 z||_2)``."""

    table: EmbeddingTable
    guarantee: TokenGuarantee
    metric_epsilon: float
    sqrt_cov: torch.Tensor

    def sample_noise(self, count: int, generator: torch.Generator) -> torch.Tensor:
        shape, f64 = (count, self.table.dim), torch.float64
        uniform = torch.rand(shape, generator=generator, dtype=f64, device=generator.device)
        # Gamma(d, scale 1/eps) with integer shape d: sum of d Exp(1) = -sum log(1 - U), / eps.
        radius = -torch.log1p(-uniform).sum(1, keepdim=True) / self.metric_epsilon  # [n, 1]
        gauss = torch.randn(shape, generator=generator, dtype=f64, device=generator.device)
        direction = gauss / gauss.norm(dim=1, keepdim=True)  # [n, d]
        return (radius * direction) @ self.sqrt_cov.to(generator.device)  # S symmetric


@dataclass(frozen=True, eq=False)
class ExponentialMechanism(TokenMechanism):
    """Samples candidate c for input row x with ``Pr ~ exp(-epsilon ||x - x_c||_2 / (2 Delta_2))``
    by Gumbel-max: ``argmax_c [-epsilon dist_c / (2 Delta_2) + G_c]``, fresh G per token."""

    table: EmbeddingTable
    guarantee: TokenGuarantee
    epsilon: float
    diameter: float

    @property
    def candidate_rows(self) -> torch.Tensor:
        """Clipped rows of the candidates ``[K, d]`` float64 (one copy per table)."""
        return table_constant(self.table, "candidate_rows", lambda: self.table.clipped[self.table.candidates])

    def distances(self, rows: torch.Tensor) -> torch.Tensor:
        """``||x - x_c||_2`` for rows ``[n, d]`` and every candidate: ``[n, K]`` float64."""
        cand = self.candidate_rows
        sq = squared_distance_scores(rows, cand, cand.pow(2).sum(-1))
        return (sq + rows.pow(2).sum(-1, keepdim=True)).clamp(min=0.0).sqrt()

    def select(self, rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Candidate positions ``[n]`` (indices into ``table.candidates``) for rows ``[n, d]``."""
        rows = rows.to(torch.float64)
        per_block = max(1, BLOCK_ELEMENTS // self.table.candidates.numel())
        coef = self.epsilon / (2.0 * self.diameter)
        picks = []
        for block in rows.split(per_block):
            logits = -coef * self.distances(block)  # [c, K]
            uniform = torch.rand(
                logits.shape, generator=generator, dtype=torch.float64, device=generator.device
            )
            gumbel = -torch.log(-torch.log(uniform)).to(logits.device)
            picks.append((logits + gumbel).argmax(dim=1))
        return torch.cat(picks) if picks else torch.empty(0, dtype=torch.int64, device=rows.device)


_TABLE_CONSTANTS: weakref.WeakKeyDictionary[EmbeddingTable, dict[Any, Any]] = weakref.WeakKeyDictionary()
_TABLE_CONSTANTS_LOCK = threading.Lock()


def table_constant(table: EmbeddingTable, key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()`` once per (``table``, ``key``), kept while the table lives: public quantities
    of the table that do not depend on epsilon. Concurrent callers wait for the first one."""
    with _TABLE_CONSTANTS_LOCK:
        constants = _TABLE_CONSTANTS.setdefault(table, {})
        if key not in constants:
            constants[key] = compute()
        return constants[key]


def token_mechanism(
    name: str,
    table: EmbeddingTable,
    epsilon: float,
    delta: float | None = None,
    *,
    effective_dim: int | None = None,
    mahalanobis_lambda: float = 0.5,
) -> TokenMechanism:
    """The per-token mechanism ``name`` (see ``MECHANISMS``) calibrated for ``table``.

    ``epsilon``: per-token epsilon (the metric epsilon per unit distance for ``mahalanobis`` and
    ``cmp``). ``delta``: required by ``trlap_corrected`` and ``gaussian_analytic``; the *claimed*
    delta of ``trlap_paper`` (default 4^-d_eff); ignored by pure-DP mechanisms and
    ``trlap_repro``. ``effective_dim``: Remark 1's dummy dimension for ``trlap_paper``.
    ``mahalanobis_lambda`` in [0, 1): Sigma_lambda = lambda Sigma + (1 - lambda) I.
    Every argument is validated (ValueError) before anything is computed.
    """
    if name not in MECHANISMS:
        raise ValueError(f"unknown token mechanism {name!r}; use one of {MECHANISMS}")
    epsilon = check_epsilon(epsilon)
    if name in NEEDS_DELTA:
        if delta is None:
            raise ValueError(f"{name} needs delta (per-token delta in (0, 1))")
        delta = check_delta(delta)
    if name == "trlap_paper" and delta is not None:
        delta = check_delta(delta)
    if effective_dim is not None:
        check_count(effective_dim, "effective_dim")
    if name == "mahalanobis" and not 0.0 <= mahalanobis_lambda < 1.0:
        raise ValueError(f"mahalanobis_lambda must lie in [0, 1), got {mahalanobis_lambda!r}")
    if name in REPRODUCTION:
        return _reproduction(name, table, epsilon, delta, effective_dim)
    if name == "expmech":
        return _exponential(table, epsilon)
    if name in ("mahalanobis", "cmp"):
        return _mahalanobis(
            name, table, epsilon, mahalanobis_lambda if name == "mahalanobis" else 0.0
        )
    return _coordinate(name, table, _core_mechanism(name, table, epsilon, delta))


def _core_mechanism(
    name: str, table: EmbeddingTable, epsilon: float, delta: float | None
) -> Mechanism:
    if name == "laplace":
        return laplace_mechanism(table.sensitivity_l1, epsilon)
    if name == "gaussian_analytic":
        return gaussian_mechanism(table.sensitivity_l2, epsilon, delta, "analytic")
    try:
        return trlaplace_mechanism(
            epsilon,
            table.dim,
            table.clip_norm,
            "corrected",
            delta,
            sensitivity_l1=table.sensitivity_l1,
            sensitivity_linf=table.sensitivity_linf,
        )
    except OverflowError:  # the corrected bound A evaluates exp(eps * linf / l1) in float64
        raise ValueError(
            f"epsilon={epsilon} is too large for the corrected TrLaplace calibration: "
            f"exp(eps * {table.sensitivity_linf:.4g} / {table.sensitivity_l1:.4g}) overflows float64"
        ) from None


def _coordinate(name: str, table: EmbeddingTable, core: Mechanism) -> CoordinateNoiseMechanism:
    guarantee = TokenGuarantee(
        name=name,
        epsilon=core.epsilon,
        delta=core.delta,
        valid=True,
        dp_event=core.dp_event,
        description=f"{name}: {core.statement()}; per token over the {table.vocab_size}-token input domain",
    )
    return CoordinateNoiseMechanism(table, guarantee, core)


def reproduction_delta(noise: Mechanism, table: EmbeddingTable) -> tuple[float, bool]:
    """True delta at ``noise.epsilon`` of a (truncated) Laplace calibration on ``table``: the exact
    maximum of the pairwise delta (``trlaplace.pair_delta``) over ALL input-domain pairs when
    ``V^2 d <= EXACT_DELTA_TERMS`` (returns ``(delta, True)``), else the maximum over an evenly
    spaced public subset of rows, which is a lower bound on the true delta (returns
    ``(delta, False)``)."""
    rows = table.clipped
    count = min(table.vocab_size, math.isqrt(EXACT_DELTA_TERMS // table.dim))
    if count < table.vocab_size:
        picks = torch.linspace(0, table.vocab_size - 1, count, device=rows.device).round().long()
        rows = rows[picks]
    chunk = max(1, BLOCK_ELEMENTS // (count * table.dim))
    return true_delta(noise, rows, chunk=chunk), count == table.vocab_size


def _reproduction(
    name: str, table: EmbeddingTable, epsilon: float, delta: float | None, effective_dim: int | None
) -> CoordinateNoiseMechanism:
    calibration = REPRODUCTION[name]
    core = trlaplace_mechanism(  # warns: the claimed delta is not a guarantee
        epsilon, table.dim, table.clip_norm, calibration, delta, effective_dim=effective_dim
    )
    real_delta, exact = reproduction_delta(core, table)
    how = (
        f"exact maximum over all {table.vocab_size}^2 input-domain pairs"
        if exact
        else "lower bound from an evenly spaced subset of input-domain rows"
    )
    verdict = (
        f"the only valid statement is ({epsilon:.6g}, {real_delta:.4g})-DP per token"
        if exact
        else "no guarantee is stated"
    )
    description = (
        f"{name} (reproduction): claims ({epsilon:.6g}, {core.delta:.3g})-DP per token, but its TRUE "
        f"per-token delta at eps={epsilon:.6g} is {real_delta:.4g} ({how}); {verdict}"
    )
    warn_not_private(f"{description}. Use trlap_corrected for a real guarantee.")
    guarantee = TokenGuarantee(
        name=name,
        epsilon=epsilon,
        delta=real_delta,
        valid=exact,
        dp_event=EpsilonDeltaDpEvent(epsilon, real_delta)
        if exact
        else dp_event.NonPrivateDpEvent(),
        description=description,
    )
    return CoordinateNoiseMechanism(table, guarantee, core)


def _exponential(table: EmbeddingTable, epsilon: float) -> ExponentialMechanism:
    diameter = table.sensitivity_l2
    guarantee = TokenGuarantee.pure(
        "expmech",
        epsilon,
        f"expmech: ({epsilon:.6g}, 0)-DP per token: exponential mechanism over "
        f"{table.candidates.numel()} fixed candidates, score -||x_w - x_c||_2 of sensitivity "
        f"Delta_2 = {diameter:.6g} (input-domain l2 diameter)",
    )
    return ExponentialMechanism(table, guarantee, epsilon, diameter)


def regularized_covariance(rows: torch.Tensor, lam: float) -> torch.Tensor:
    """``Sigma_lambda = lam * Sigma + (1 - lam) I`` ``[d, d]`` float64, with ``Sigma`` the
    covariance of the public ``rows [V, d]`` rescaled to trace d (so both terms share a scale)."""
    centred = rows - rows.mean(dim=0)
    cov = centred.T @ centred / rows.shape[0]  # [d, d]
    trace = float(cov.trace())
    if not trace > 0:
        raise ValueError("the table's rows are all equal: its covariance is zero")
    eye = torch.eye(rows.shape[1], dtype=torch.float64, device=rows.device)
    return lam * cov * (rows.shape[1] / trace) + (1.0 - lam) * eye


def metric_geometry(table: EmbeddingTable, lam: float) -> tuple[torch.Tensor, float]:
    """(``S = Sigma_lambda^(1/2)`` ``[d, d]`` float64, the diameter ``Delta_2`` of the table in the
    metric ``||S^-1 (x - x')||_2``): one eigendecomposition and one O(V^2 d) diameter per table
    and lambda (the Euclidean diameter and ``S = I`` for CMP, lambda = 0)."""

    def compute() -> tuple[torch.Tensor, float]:
        eigenvalues, eigenvectors = torch.linalg.eigh(regularized_covariance(table.clipped, lam))
        sqrt_cov = eigenvectors @ torch.diag(eigenvalues.sqrt()) @ eigenvectors.T  # [d, d]
        if lam == 0.0:
            return sqrt_cov, table.sensitivity_l2
        inv_sqrt = eigenvectors @ torch.diag(eigenvalues.rsqrt()) @ eigenvectors.T  # [d, d]
        return sqrt_cov, l2_diameter(table.clipped @ inv_sqrt)

    return table_constant(table, ("metric_geometry", float(lam)), compute)


def _mahalanobis(
    name: str, table: EmbeddingTable, metric_epsilon: float, lam: float
) -> MahalanobisMechanism:
    sqrt_cov, diameter = metric_geometry(table, lam)
    epsilon = metric_epsilon * diameter
    metric = "||x - x'||_2" if lam == 0.0 else f"||Sigma_{lam:g}^(-1/2) (x - x')||_2"
    guarantee = TokenGuarantee.pure(
        name,
        epsilon,
        f"{name}: {metric_epsilon:.6g}-metric-DP per token w.r.t. d(x, x') = {metric} (epsilon "
        f"per unit of that distance); over the input domain (diameter Delta_2 = {diameter:.6g}) "
        f"this is ({epsilon:.6g}, 0)-DP per token (eps_DP = eps_m * Delta_2)",
        metric_epsilon=metric_epsilon,
    )
    return MahalanobisMechanism(table, guarantee, metric_epsilon, sqrt_cov)
