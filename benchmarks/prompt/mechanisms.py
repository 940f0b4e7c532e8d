"""The mechanisms of ``python -m benchmarks.prompt`` at a grid eps (metric-DP rescaled to the canonical per-token
eps), their noise seeds, and the statistics: DP keep bounds, the Hoeffding tolerance, bootstrap CIs."""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from benchmarks.prompt.settings import Settings
from vllm_dp_plugin.privacy.mechanisms import NotDifferentiallyPrivateWarning
from vllm_dp_plugin.privacy.trlaplace import (
    REPO_DELTA_ROOT,
    paper_effective_dim,
    repo_effective_dim,
)
from vllm_dp_plugin.prompt import EmbeddingTable, TokenGuarantee, TokenMechanism, token_mechanism
from vllm_dp_plugin.prompt.mechanisms import MahalanobisMechanism

METRIC_DP = ("mahalanobis", "cmp")
REPRODUCTION = ("trlap_paper", "trlap_repro")
HOEFFDING_ALPHA = 1e-6  # failure probability of the N_w-vs-bound tolerance


def rescale_metric(base: MahalanobisMechanism, epsilon_dp: float) -> MahalanobisMechanism:
    """``base`` (a metric-DP mechanism) re-calibrated to the converted per-token guarantee
    ``epsilon_dp = eps_m * Delta_2``: same noise law as ``token_mechanism(name, table, eps_m)``
    with ``eps_m = epsilon_dp / Delta_2``, without recomputing the 30k^2 diameter Delta_2."""
    diameter = base.guarantee.epsilon / base.metric_epsilon
    metric = epsilon_dp / diameter
    guarantee = TokenGuarantee.pure(
        base.name,
        metric * diameter,
        f"{base.name}: {metric:.6g}-metric-DP per token (epsilon per unit of the mechanism's "
        f"distance); over the input domain (diameter Delta_2 = {diameter:.6g}) this is "
        f"({metric * diameter:.6g}, 0)-DP per token (eps_DP = eps_m * Delta_2)",
        metric_epsilon=metric,
    )
    return dataclasses.replace(base, guarantee=guarantee, metric_epsilon=metric)


@dataclass
class Built:
    """One calibrated mechanism (or why it is undefined) and its privacy statement."""

    mechanism: TokenMechanism | None
    info: dict = field(default_factory=dict)


def build_mechanism(name: str, table: EmbeddingTable, eps: float, settings: Settings, cache: dict) -> Built:
    """The mechanism ``name`` at per-token eps ``eps`` (converted eps for metric DP).

    ``info``: ``epsilon``/``delta``/``valid`` of the honest guarantee, ``metric_epsilon``,
    ``claimed_delta``/``claimed_log10_delta``/``effective_dim`` for reproductions, ``error`` when
    the calibration is undefined at this eps (e.g. Thm 3 for trlap_repro above eps ~20.6)."""
    info: dict = {"mechanism": name, "eps": eps}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotDifferentiallyPrivateWarning)  # stated in the report
            if name in METRIC_DP:
                if name not in cache:
                    cache[name] = token_mechanism(
                        name, table, 1.0, mahalanobis_lambda=settings.mahalanobis_lambda
                    )
                mech = rescale_metric(cache[name], eps)
            elif name == "trlap_paper":
                d_eff = paper_effective_dim(eps, table.dim)
                mech = token_mechanism(name, table, eps, effective_dim=d_eff)
                info["effective_dim"] = d_eff
            elif name == "trlap_repro":
                info["effective_dim"] = repo_effective_dim(eps, table.dim)
                mech = token_mechanism(name, table, eps)
            else:
                mech = token_mechanism(name, table, eps, settings.delta)
    except ValueError as exc:
        info.update(error=str(exc), build_s=time.perf_counter() - start)
        return Built(None, info)
    g = mech.guarantee
    info.update(epsilon=g.epsilon, delta=g.delta, valid=g.valid, metric_epsilon=g.metric_epsilon,
                statement=g.statement(), build_s=time.perf_counter() - start)
    if name in REPRODUCTION:
        info["claimed_delta"] = mech.noise.delta
        info["claimed_log10_delta"] = info["effective_dim"] * math.log10(REPO_DELTA_ROOT)
        info["true_delta_exact"] = g.valid  # False: an exact maximum over a subset of rows
    return Built(mech, info)


def noise_seed(seed: int, name: str, eps: float) -> int:
    """Seed of one (mechanism, eps) run: independent of which other runs are in the grid."""
    return zlib.crc32(f"{seed}/{name}/{eps:.12g}".encode())


def keep_bound(eps: float, delta: float, vocab: int) -> float:
    """``(e^eps + V delta) / V`` capped at 1, the vocabulary-average keep-rate bound of any
    (eps, delta)-DP token mechanism."""
    if eps > 700:
        return 1.0
    return min(1.0, (math.exp(eps) + vocab * delta) / vocab)


def text_keep_bound(freqs: Sequence[float], eps: float, delta: float, vocab: int) -> float:
    """Bound on the expected N_w of a text with piece frequencies ``freqs`` (summing to 1).

    For an (eps, delta)-DP token mechanism the keep probabilities p_w satisfy ``sum_w p_w <=
    e^eps + V delta`` (sum ``p_w <= e^eps Pr[w' -> w] + delta`` over w for a fixed w') and
    ``p_w <= 1``, so ``E[N_w] = sum_w f_w p_w`` is at most the budget spent greedily on the most
    frequent pieces."""
    budget = math.inf if eps > 700 else math.exp(eps) + vocab * delta
    if budget >= len(freqs):
        return 1.0  # every piece of the text can be kept
    total = 0.0
    for f in sorted(freqs, reverse=True):
        take = min(1.0, budget)
        total += take * f
        budget -= take
        if budget <= 0:
            break
    return min(1.0, total)


def hoeffding_tolerance(tokens: int, alpha: float = HOEFFDING_ALPHA) -> float:
    """N_w is a mean of independent per-token Bernoullis (fresh noise per token): it exceeds its
    expectation by more than this with probability <= ``alpha`` (Hoeffding)."""
    return math.sqrt(math.log(1.0 / alpha) / (2.0 * tokens))


def bootstrap_ci(num: np.ndarray, den: np.ndarray | None, draws: np.ndarray) -> tuple[float, float]:
    """95% percentile CI of ``sum(num) / sum(den)`` (or the mean of ``num``) over the sentence
    resamples ``draws [B, S]``."""
    if den is None:
        stats = num[draws].mean(1)
    else:
        stats = num[draws].sum(1) / np.maximum(den[draws].sum(1), 1e-300)
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float(lo), float(hi)
