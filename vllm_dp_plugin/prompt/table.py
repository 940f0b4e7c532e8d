"""The public embedding table every token mechanism works in (noise, projection, candidates).

Built once from the served model's input-embedding matrix, which is public (part of the
weights), so everything here is public and costs no privacy:

* padded rows (index >= vocabulary size) are dropped; the remaining rows are the *input domain*
  (every token a user can send, special tokens included);
* optional centring on the input-domain mean (pairwise differences unchanged, norms shrink);
* rowwise l2 clipping to ``C`` = a quantile of the centred row norms (Eq. 1);
* the fixed candidate set: input-domain ids minus the special/added/reserved ids; it never
  depends on the input being privatized;
* sensitivities over *all* input-domain pairs (word-level DP quantifies only over those pairs,
  so bounds over the input domain are valid): l1 <= min(2 sqrt(d) R, sum_j range_j),
  linf <= min(2 R, max_j range_j) with R the largest clipped norm (= C up to rounding), and
  l2 = the exact diameter of the clipped rows (chunked float64 GEMM, on first use).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import torch

from ..kernels.nearest_reference import squared_distance_scores
from ..privacy.validation import check_count, check_positive

DIAMETER_BLOCK_ELEMENTS = 1 << 24  # float64 entries of one [c, V] block of the diameter GEMM


def clip_rows(rows: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """Eq. (1): ``rows [V, d] * min(1, C / ||row||_2)`` (zero rows stay zero); same dtype."""
    norms = rows.norm(dim=1, keepdim=True)  # [V, 1]
    return rows * (clip_norm / norms).clamp(max=1.0)


def coordinate_ranges(rows: torch.Tensor) -> torch.Tensor:
    """``max_w x_wj - min_w x_wj`` for every coordinate j of ``rows [V, d]``: ``[d]``."""
    return rows.max(dim=0).values - rows.min(dim=0).values


def l2_diameter(rows: torch.Tensor) -> float:
    """Upper bound on ``max_{w, w'} ||x_w - x_w'||_2`` over ``rows [V, d]`` (float64), exact up to
    a rigorous float64 rounding margin: chunked ``||a||^2 + ||b||^2 - 2 <a, b>`` GEMMs.

    The margin ``(d + 4) * 2^-52 * (2 R)^2`` (R = max row norm) dominates the rounding error of
    the GEMM expansion, so the result is never below the true diameter.
    """
    rows = rows.to(torch.float64)
    sq = rows.pow(2).sum(-1)  # [V]
    chunk = max(1, DIAMETER_BLOCK_ELEMENTS // rows.shape[0])
    worst = 0.0
    for start in range(0, rows.shape[0], chunk):
        block = rows[start : start + chunk]  # [c, d]
        dist_sq = squared_distance_scores(block, rows, sq) + sq[start : start + chunk, None]
        worst = max(worst, float(dist_sq.max()))
    margin = (rows.shape[1] + 4) * torch.finfo(torch.float64).eps * 4.0 * float(sq.max())
    return math.sqrt(worst + margin)


def candidate_ids(
    vocab_size: int, special_ids: Iterable[int], device: torch.device
) -> torch.Tensor:
    """Sorted int64 ids in ``[0, vocab_size)`` minus ``special_ids``; raises on an out-of-range
    special id or an empty result."""
    keep = torch.ones(vocab_size, dtype=torch.bool, device=device)
    for token in special_ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(f"special id {token!r} is not a token id in [0, {vocab_size})")
        keep[token] = False
    ids = keep.nonzero().squeeze(1)
    if ids.numel() == 0:
        raise ValueError("every input-domain id is special: the candidate set is empty")
    return ids


@dataclass(frozen=True, eq=False)
class EmbeddingTable:
    """Public, fixed geometry of the input domain; see the module docstring.

    ``embeddings [V, d]``: the model's input-embedding rows of the input domain (a view of the
    matrix given to ``build``, model dtype), used for pass-through rows in embedding mode.
    ``mean [d]`` float64: the centring vector (zeros when centring is off).
    ``clipped [V, d]`` float64: ``clip(embeddings - mean, C)``, the table used for noise AND
    projection. ``clip_norm``: C, in embedding units. ``candidates [K]`` int64: sorted ids that
    may be output. ``sensitivity_l1`` / ``sensitivity_linf``: bounds on ``||x_w - x_w'||`` over
    all input-domain pairs of clipped rows, in embedding units.
    """

    embeddings: torch.Tensor
    mean: torch.Tensor
    clipped: torch.Tensor
    clip_norm: float
    candidates: torch.Tensor
    sensitivity_l1: float
    sensitivity_linf: float

    @classmethod
    def build(
        cls,
        embeddings: torch.Tensor,
        vocab_size: int,
        special_ids: Iterable[int] = (),
        *,
        center: bool = True,
        clip_quantile: float = 0.5,
        clip_norm: float | None = None,
    ) -> EmbeddingTable:
        """Table from the input-embedding matrix ``embeddings [V_rows, d]``.

        ``vocab_size``: tokenizer length; rows ``>= vocab_size`` are padding and dropped.
        ``special_ids``: every id that must never be output (special, control, added, reserved).
        ``clip_quantile`` in (0, 1]: C is this quantile of the (centred) row norms, unless
        ``clip_norm`` gives C explicitly.
        """
        if embeddings.dim() != 2 or not embeddings.is_floating_point():
            raise ValueError(
                f"embeddings must be a float [V_rows, d] matrix, got {embeddings.shape}"
            )
        vocab_size = check_count(vocab_size, "vocab_size")
        if vocab_size > embeddings.shape[0]:
            raise ValueError(
                f"vocab_size {vocab_size} exceeds the {embeddings.shape[0]} table rows"
            )
        if not 0.0 < clip_quantile <= 1.0:
            raise ValueError(f"clip_quantile must lie in (0, 1], got {clip_quantile!r}")
        domain = embeddings[:vocab_size]  # [V, d]
        rows = domain.to(torch.float64)
        if not bool(torch.isfinite(rows).all()):
            raise ValueError("embeddings contain NaN or inf")
        mean = rows.mean(dim=0) if center else torch.zeros_like(rows[0])
        centred = rows - mean
        if clip_norm is None:
            clip_norm = float(torch.quantile(centred.norm(dim=1), clip_quantile))
        clip_norm = check_positive(clip_norm, "clip_norm")
        clipped = clip_rows(centred, clip_norm)
        radius = float(clipped.norm(dim=1).max())  # <= C up to rounding
        ranges = coordinate_ranges(clipped)
        return cls(
            embeddings=domain,
            mean=mean,
            clipped=clipped,
            clip_norm=clip_norm,
            candidates=candidate_ids(vocab_size, special_ids, embeddings.device),
            sensitivity_l1=min(2.0 * math.sqrt(rows.shape[1]) * radius, float(ranges.sum())),
            sensitivity_linf=min(2.0 * radius, float(ranges.max())),
        )

    @property
    def vocab_size(self) -> int:
        """V: number of input-domain rows (valid input ids are ``[0, V)``)."""
        return self.clipped.shape[0]

    @property
    def dim(self) -> int:
        """d: embedding dimension."""
        return self.clipped.shape[1]

    @cached_property
    def sensitivity_l2(self) -> float:
        """Exact l2 diameter of the clipped input domain (<= 2C), computed once on first use:
        O(V^2 d) float64 GEMM work, only needed by the Gaussian and exponential mechanisms."""
        return l2_diameter(self.clipped)
