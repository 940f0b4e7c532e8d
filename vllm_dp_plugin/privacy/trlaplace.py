"""High-dimensional truncated Laplace (TrLaplace) for clipped embeddings in R^d.

Three calibrations of the same i.i.d. per-coordinate law ``LaplaceNoise(1/alpha, A)``:

* ``corrected`` (default): ``alpha = eps/D1``,
  ``A = (D1/eps) ln(1 + (D1/Dinf) (e^{eps Dinf/D1} - 1) / (2 delta))``; valid (eps, delta)-DP
  (when A >= Dinf) for any two inputs with ``||x - x'||_1 <= D1`` and ``||x - x'||_inf <= Dinf``
  (clipping gives D1 = 2 sqrt(d) C, Dinf = 2C). At d = 1 it is Geng et al.'s 1-D truncated
  Laplace; in high d its variance is within ~1% of plain Laplace.
* ``paper`` (Thm 3 exactly as printed): NOT (eps, delta)-DP for d > 1: its proof bounds the mass
  where *all* coordinates leave the other input's support, but one coordinate suffices (d = 300,
  eps = 0.1, inputs +-C e_1: an event of probability 0.248 under one and 0 under the other,
  against a claimed delta of 4^-300); paper-literal reproduction only. ``pair_delta`` /
  ``sparse_pair_delta`` compute the delta it really has.
* ``repo`` (the authors' code path): Thm 3 with delta^(1/d) = 1/4 and the dummy-dimension switch
  ``d_eff = 500 if eps == 10 else 1700`` for eps > 8.6; pass ``clip_norm=REPO_CLIP_NORM`` to use
  the repo's calibration constant. Reproduction only, equally not DP.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from dp_accounting import dp_event

from .mechanisms import Mechanism, eps_delta_laplace, warn_not_private
from .noise import LaplaceNoise
from .validation import check_count, check_delta, check_epsilon, check_positive

TrLaplaceCalibration = Literal["corrected", "paper", "repo"]
REPO_CLIP_NORM = 0.005
REPO_DELTA_ROOT = 0.25


def trlaplace_mechanism(
    epsilon: float,
    dim: int,
    clip_norm: float,
    calibration: TrLaplaceCalibration = "corrected",
    delta: float | None = None,
    *,
    sensitivity_l1: float | None = None,
    sensitivity_linf: float | None = None,
    effective_dim: int | None = None,
) -> Mechanism:
    """TrLaplace noise for embeddings clipped to l2 norm ``clip_norm`` in R^``dim``.

    ``corrected``: needs ``delta``; ``sensitivity_l1``/``sensitivity_linf`` may tighten the
    clipping bounds with public input-domain bounds (word-level DP quantifies only over pairs of
    input-domain tokens, so any bound over them is valid). ``paper``: ``delta`` is the
    claimed delta (default 4^-d_eff); ``effective_dim`` is Remark 1's dummy dimension.
    ``repo``: ignores ``delta``/``effective_dim`` and uses the repo's constants.
    """
    epsilon = check_epsilon(epsilon)
    dim = check_count(dim, "dim")
    clip_norm = check_positive(clip_norm, "clip_norm")
    if calibration == "corrected":
        return _corrected(epsilon, dim, clip_norm, delta, sensitivity_l1, sensitivity_linf)
    if calibration == "paper":
        d_eff = check_count(effective_dim or dim, "effective_dim")
        log_delta_root = (
            math.log(REPO_DELTA_ROOT) if delta is None else math.log(check_delta(delta)) / d_eff
        )
        return _theorem_3(epsilon, dim, clip_norm, d_eff, log_delta_root, "paper")
    if calibration == "repo":
        d_eff = repo_effective_dim(epsilon, dim)
        return _theorem_3(epsilon, dim, clip_norm, d_eff, math.log(REPO_DELTA_ROOT), "repo")
    raise ValueError(f"unknown TrLaplace calibration {calibration!r}; use corrected, paper or repo")


def paper_effective_dim(epsilon: float, dim: int) -> int:
    """Remark 1's dummy dimension for ``trlap_paper`` (claimed delta 4^-d_eff): the smallest
    d_eff >= d with Thm 3's condition ``eps <= 2 delta^(1/d_eff) sqrt(d_eff)``, i.e. 4 eps^2."""
    need = math.ceil((epsilon / (2.0 * REPO_DELTA_ROOT)) ** 2)
    while epsilon / (2.0 * REPO_DELTA_ROOT * math.sqrt(need)) > 1.0:  # float rounding
        need += 1
    return max(dim, need)


def repo_effective_dim(epsilon: float, dim: int) -> int:
    """The authors' code: ``if eps > 8.6: embs_dim = 500 if eps == 10 else 1700``."""
    if epsilon > 8.6:
        return 500 if epsilon == 10 else 1700
    return dim


def _corrected(
    epsilon: float,
    dim: int,
    clip_norm: float,
    delta: float | None,
    sensitivity_l1: float | None,
    sensitivity_linf: float | None,
) -> Mechanism:
    if delta is None:
        raise ValueError("the corrected TrLaplace calibration needs delta")
    delta = check_delta(delta)
    d1 = check_positive(sensitivity_l1 or 2.0 * math.sqrt(dim) * clip_norm, "sensitivity_l1")
    dinf = check_positive(sensitivity_linf or 2.0 * clip_norm, "sensitivity_linf")
    # A = (D1/eps) ln(1 + (D1/Dinf) (e^{eps Dinf/D1} - 1) / (2 delta)): the union bound over
    # coordinates of the support-exit probability (1-p)(e^{alpha |Delta_j|} - 1)/(2p), maximised
    # over ||Delta||_1 <= D1, ||Delta||_inf <= Dinf by convexity, set equal to delta
    bound = (d1 / epsilon) * math.log1p((d1 / dinf) * math.expm1(epsilon * dinf / d1) / (2 * delta))
    if bound < dinf:
        raise ValueError(
            f"corrected TrLaplace bound A={bound:.4g} < Dinf={dinf:.4g}: the corrected proof does not "
            "apply; lower delta"
        )
    return eps_delta_laplace("trlaplace(corrected)", epsilon, delta, d1, bound)


def _theorem_3(
    epsilon: float, dim: int, clip_norm: float, d_eff: int, log_delta_root: float, label: str
) -> Mechanism:
    """Thm 3 as printed, in closed form: alpha = eps/(2 sqrt(d_eff) C),
    p = 1 - e^{-alpha A} = eps/(2 delta^(1/d_eff) sqrt(d_eff))."""
    if d_eff < dim:
        raise ValueError(f"effective_dim {d_eff} must be >= dim {dim}")
    delta_root = math.exp(log_delta_root)
    d1 = 2.0 * math.sqrt(d_eff) * clip_norm
    alpha = epsilon / d1
    p = epsilon / (2.0 * delta_root * math.sqrt(d_eff))
    if p > 1.0:
        need = math.ceil((epsilon / (2.0 * delta_root)) ** 2)
        raise ValueError(
            f"Thm 3 requires eps <= 2 delta^(1/d) sqrt(d); raise effective_dim to >= {need} "
            "(Remark 1's dummy dimensions)"
        )
    bound = math.inf if p == 1.0 else -math.log1p(-p) / alpha
    claimed_delta = math.exp(d_eff * log_delta_root)
    warn_not_private(
        f"TrLaplace '{label}' calibration (eps={epsilon}, claimed delta=exp({d_eff * log_delta_root:.4g})) "
        "is NOT (eps, delta)-DP for d > 1 (the paper's Thm 3 is false there): its true delta is up to ~1. "
        "Use calibration='corrected' for a real guarantee."
    )
    return Mechanism(
        name=f"trlaplace({label})",
        epsilon=epsilon,
        delta=claimed_delta,
        sensitivity=d1,
        sensitivity_norm="l1",
        noise=LaplaceNoise(1.0 / alpha, bound),
        dp_event=dp_event.NonPrivateDpEvent(),
        valid=False,
    )


def _exit_probability(noise: LaplaceNoise, shift: torch.Tensor) -> torch.Tensor:
    """q(t) = P[eta > A - t] for one coordinate shifted by t = |Delta_j|: the probability that
    this coordinate of x + eta falls outside the support of x' + eta'."""
    if math.isinf(noise.bound):
        return torch.zeros_like(shift)
    scale, bound = noise.scale, noise.bound
    denom = 2.0 * math.expm1(bound / scale)
    inner = torch.expm1(shift / scale) / denom
    outer = 1.0 - torch.expm1((2.0 * bound - shift).clamp(min=0.0) / scale) / denom
    return torch.where(shift <= bound, inner, torch.where(shift < 2 * bound, outer, 1.0))


def pair_delta(mechanism: Mechanism, diff: torch.Tensor) -> torch.Tensor:
    """Exact delta(eps) between inputs x and x' with x - x' = ``diff`` ([..., d]): the mass of
    outputs outside the other input's support (inside it the density ratio is at most e^eps).

    Valid when ``||diff||_1 / scale <= eps``, which clipping guarantees; raises otherwise.
    Returns ``1 - prod_j (1 - q(|diff_j|))`` computed as ``-expm1(sum log1p(-q))``, shape [...].
    """
    noise = mechanism.noise
    if not isinstance(noise, LaplaceNoise):
        raise TypeError("pair_delta applies to (truncated) Laplace noise only")
    shift = diff.abs().to(torch.float64)
    privacy_loss = shift.sum(-1) / noise.scale
    if bool((privacy_loss > mechanism.epsilon * (1 + 1e-9)).any()):
        raise ValueError("pair_delta needs ||x - x'||_1 / scale <= epsilon (clip the inputs first)")
    q = _exit_probability(noise, shift)
    return -torch.expm1(torch.log1p(-q).sum(-1))


def true_delta(mechanism: Mechanism, points: torch.Tensor, chunk: int = 256) -> float:
    """max over all pairs of ``points`` ([N, d], the public input domain) of ``pair_delta``."""
    points = points.to(torch.float64)
    worst = 0.0
    for start in range(0, points.shape[0], chunk):
        block = points[start : start + chunk]  # [c, d]
        diffs = block[:, None, :] - points[None, :, :]  # [c, N, d]
        worst = max(worst, float(pair_delta(mechanism, diffs).max()))
    return worst


def sparse_pair_delta(mechanism: Mechanism, dim: int, clip_norm: float) -> tuple[float, int]:
    """Worst delta over the antipodal k-sparse pairs of the l2 ball of radius C in R^dim.

    x = C (1,..,1,0,..)/sqrt(k), x' = -x for k = 1..dim (k = 1 is the axis pair). A lower bound
    on the mechanism's delta over the whole ball. Returns (delta, worst k).
    """
    k = torch.arange(1, dim + 1, dtype=torch.float64)
    shift = 2.0 * clip_norm / torch.sqrt(k)
    q = _exit_probability(mechanism.noise, shift)  # [dim]
    deltas = -torch.expm1(k * torch.log1p(-q))
    best = int(torch.argmax(deltas))
    return float(deltas[best]), best + 1
