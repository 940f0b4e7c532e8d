"""Full-ranking evaluation: the held-out item is ranked among ALL items (the DPFormer paper does
not state its protocol, but it must be full ranking: under SASRec's 1 positive + 100 sampled
negatives a random ranker already scores HIT@10 ~ 9.9%, above the paper's DP GRU/LSTM rows).

Protocol: the pad id is never a candidate; with ``exclude`` (default in ``evaluate_ranking``: the
user's input history) those items are removed from the candidates too (the RecBole convention;
the paper is silent), except the target itself, so a repeated purchase stays rankable. Rank
``r`` (from 0) counts the candidates scoring above the target plus every other candidate tied
with it (pessimistic ties: a constant scorer gets no credit). ``HIT@k = [r < k]``,
``NDCG@k = [r < k] / log2(r + 2)``, averaged over users.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RankingMetrics:
    """Mean ``NDCG@k`` and ``HIT@k`` (fractions in [0, 1], not %) over ``users`` users."""

    ndcg: float
    hit: float
    k: int
    users: int


def candidate_mask(
    num_items: int, targets: torch.Tensor, exclude: torch.Tensor | None, pad_id: int = 0
) -> torch.Tensor:
    """``[U, num_items]`` bool, True where an item is NOT a candidate: the pad id, and the ids in
    ``exclude: [U, L]`` (pad entries allowed) other than the user's own ``targets: [U]``."""
    masked = torch.zeros(targets.shape[0], num_items, dtype=torch.bool, device=targets.device)
    if exclude is not None:
        masked.scatter_(1, exclude, True)
        masked[torch.arange(targets.shape[0], device=targets.device), targets] = False
    masked[:, pad_id] = True
    return masked


def target_ranks(
    scores: torch.Tensor,
    targets: torch.Tensor,
    exclude: torch.Tensor | None = None,
    pad_id: int = 0,
) -> torch.Tensor:
    """``scores: [U, M]``, ``targets: [U]`` item ids -> ``[U]`` int64 0-based rank of each target
    among the candidates (module docstring). NaN scores raise: they would compare as 'not above'."""
    if scores.dim() != 2 or targets.shape != scores.shape[:1]:
        raise ValueError(
            f"need scores [U, M] and targets [U], got {tuple(scores.shape)}, {tuple(targets.shape)}"
        )
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores contain NaN")
    if bool((targets == pad_id).any()):
        raise ValueError("a target is the pad id")
    masked = candidate_mask(scores.shape[1], targets, exclude, pad_id)
    scores = scores.masked_fill(masked, -math.inf)
    own = scores.gather(1, targets[:, None])
    above = (scores > own).sum(1)
    ties = (scores == own).sum(1) - 1  # the target ties with itself
    return above + ties


def ndcg_hit(ranks: torch.Tensor, k: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """``ranks: [U]`` 0-based -> per-user ``(NDCG@k, HIT@k)``, each ``[U]`` float64."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k!r}")
    hit = (ranks < k).double()
    return hit / torch.log2(ranks.double() + 2.0), hit


def full_ranking_metrics(
    scores: torch.Tensor,
    targets: torch.Tensor,
    exclude: torch.Tensor | None = None,
    k: int = 10,
    pad_id: int = 0,
) -> RankingMetrics:
    """Mean NDCG@k / HIT@k of ``scores: [U, M]`` for ``targets: [U]``; ``exclude: [U, L]``."""
    return summarize(target_ranks(scores, targets, exclude, pad_id), k)


def summarize(ranks: torch.Tensor, k: int = 10) -> RankingMetrics:
    """Mean NDCG@k / HIT@k of 0-based ``ranks: [U]``."""
    ndcg, hit = ndcg_hit(ranks, k)
    return RankingMetrics(float(ndcg.mean()), float(hit.mean()), k, int(ranks.shape[0]))


@torch.no_grad()
def evaluate_ranking(
    score_fn: Callable[[torch.Tensor], torch.Tensor],
    ids: torch.Tensor,
    targets: torch.Tensor,
    k: int = 10,
    batch_size: int = 1024,
    exclude_history: bool = True,
    pad_id: int = 0,
) -> RankingMetrics:
    """Full ranking of ``targets: [U]`` given inputs ``ids: [U, L]``; ``score_fn`` maps a batch
    of inputs ``[b, L]`` to scores ``[b, M]`` (e.g. ``DPFormerRec.last_scores`` in eval mode).
    Users are processed in batches of ``batch_size``; the inputs are the excluded history when
    ``exclude_history``."""
    if targets.shape[0] == 0:
        raise ValueError("no users to evaluate")
    ranks = torch.cat(
        [
            target_ranks(score_fn(batch), target, batch if exclude_history else None, pad_id).cpu()
            for batch, target in zip(ids.split(batch_size), targets.split(batch_size), strict=True)
        ]
    )
    return summarize(ranks, k)


__all__ = [
    "RankingMetrics",
    "candidate_mask",
    "evaluate_ranking",
    "full_ranking_metrics",
    "ndcg_hit",
    "summarize",
    "target_ranks",
]
