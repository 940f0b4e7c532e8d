"""Synthetic long-tailed sequential interactions and the SASRec leave-one-out split.

Generative model (seeded, ``torch.Generator`` on CPU): items ``1..num_items`` (0 is the pad id)
have Zipf popularity ``w_i ~ rank_i^-zipf_exponent`` (ranks a random permutation) and belong to
one of ``num_clusters`` clusters. A user's first item is drawn by popularity; each next item, with
probability ``stickiness``, from the previous item's cluster (popularity-weighted within it), else
from the global popularity, never repeating an item of the same user. The cluster transitions are
the learnable structure a sequence model can exploit and a popularity ranking cannot. Lengths are
``min_len + Geometric`` with mean ``mean_len``, capped at ``max_len``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .recsys import IGNORE

PAD = 0


@dataclass(frozen=True)
class SyntheticConfig:
    """Sizes and knobs of the generator; ``seed`` makes the data deterministic."""

    num_users: int = 2000
    num_items: int = 1000
    num_clusters: int = 20
    zipf_exponent: float = 1.0
    stickiness: float = 0.8
    min_len: int = 5
    mean_len: float = 15.0
    max_len: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_users", "num_items", "num_clusters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 3 <= self.min_len <= self.max_len:
            raise ValueError(
                f"need 3 <= min_len <= max_len (leave-one-out needs 3 items), got "
                f"min_len={self.min_len}, max_len={self.max_len}"
            )
        if not self.min_len <= self.mean_len <= self.max_len:
            raise ValueError(f"mean_len must lie in [min_len, max_len], got {self.mean_len!r}")
        if self.max_len > self.num_items:
            raise ValueError("max_len must not exceed num_items (items never repeat within a user)")
        if (
            not 0.0 <= self.stickiness < 1.0
        ):  # < 1: the global part keeps every unseen item drawable
            raise ValueError(f"stickiness must lie in [0, 1), got {self.stickiness!r}")
        if self.zipf_exponent < 0:
            raise ValueError(f"zipf_exponent must be >= 0, got {self.zipf_exponent!r}")

    @property
    def vocab_size(self) -> int:
        """Number of ids including the pad id 0."""
        return self.num_items + 1


@dataclass(frozen=True)
class Interactions:
    """``items: [N, max_len]`` int64 chronological item ids, right-padded with 0;
    ``lengths: [N]`` int64 number of real items per user."""

    items: torch.Tensor
    lengths: torch.Tensor


def generate_interactions(cfg: SyntheticConfig) -> Interactions:
    """Draw the users' sequences (deterministic for a given ``cfg``)."""
    g = torch.Generator().manual_seed(cfg.seed)
    popularity = _zipf_popularity(cfg, g)  # [M] (index 0 = pad, weight 0)
    cluster = torch.randint(cfg.num_clusters, (cfg.vocab_size,), generator=g)
    within = popularity * (cluster[None, :] == torch.arange(cfg.num_clusters)[:, None])  # [K, M]
    within = within / within.sum(1, keepdim=True).clamp_min(1e-300)
    popularity = popularity / popularity.sum()
    seen = torch.zeros(cfg.num_users, cfg.vocab_size, dtype=torch.bool)
    seen[:, PAD] = True
    items = torch.empty(cfg.num_users, cfg.max_len, dtype=torch.int64)
    weights = popularity.expand(cfg.num_users, -1)
    for step in range(cfg.max_len):
        nxt = _categorical(weights.masked_fill(seen, 0.0), g)
        items[:, step] = nxt
        seen[torch.arange(cfg.num_users), nxt] = True
        weights = cfg.stickiness * within[cluster[nxt]] + (1.0 - cfg.stickiness) * popularity
    lengths = _lengths(cfg, g)
    items = items.masked_fill(torch.arange(cfg.max_len)[None, :] >= lengths[:, None], PAD)
    return Interactions(items, lengths)


def _categorical(weights: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """One draw per row of ``weights: [N, M]`` (float64, >= 0, positive row sums) -> ``[N]``, by
    inverse CDF (zero-weight entries are never drawn; much faster than ``torch.multinomial``)."""
    cdf = weights.cumsum(1)
    u = torch.rand(weights.shape[0], 1, generator=g, dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(weights.shape[1] - 1)


def _zipf_popularity(cfg: SyntheticConfig, g: torch.Generator) -> torch.Tensor:
    """``[vocab_size]`` float64 weights ``rank^-s`` over a random ranking of the items; pad 0."""
    ranks = torch.randperm(cfg.num_items, generator=g).double() + 1.0
    return torch.cat([torch.zeros(1, dtype=torch.float64), ranks.pow(-cfg.zipf_exponent)])


def _lengths(cfg: SyntheticConfig, g: torch.Generator) -> torch.Tensor:
    """``[N]`` int64: ``min_len + Geometric(p)`` (mean ``mean_len``), capped at ``max_len``."""
    extra = cfg.mean_len - cfg.min_len
    if extra == 0:
        return torch.full((cfg.num_users,), cfg.min_len, dtype=torch.int64)
    p = 1.0 / (1.0 + extra)  # failures before the first success: mean (1 - p) / p = extra
    u = torch.rand(cfg.num_users, generator=g, dtype=torch.float64).clamp_min(1e-300)
    failures = torch.floor(torch.log(u) / torch.log1p(torch.tensor(-p, dtype=torch.float64)))
    return (cfg.min_len + failures.long()).clamp_max(cfg.max_len)


@dataclass(frozen=True)
class LeaveOneOut:
    """SASRec split of ``Interactions`` (``s_1..s_n`` per user), all left-padded to width ``L``
    (keeping the most recent items):

    * training: ``s_1..s_{n-2}``: ``train_ids [N, L]`` = inputs ``s_1..s_{n-3}``,
      ``train_targets [N, L]`` = next items ``s_2..s_{n-2}`` (``IGNORE`` = -100 where no input);
    * validation: ``valid_ids [N, L]`` = ``s_1..s_{n-2}``, ``valid_target [N]`` = ``s_{n-1}``;
    * test: ``test_ids [N, L]`` = ``s_1..s_{n-1}``, ``test_target [N]`` = ``s_n``.
    """

    train_ids: torch.Tensor
    train_targets: torch.Tensor
    valid_ids: torch.Tensor
    valid_target: torch.Tensor
    test_ids: torch.Tensor
    test_target: torch.Tensor


def recent_window(items: torch.Tensor, end: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """``items: [N, T]``, ``end: [N]`` -> ``[N, width]``: ``items[n, end_n - width : end_n]``
    right-aligned, positions before the start filled with ``fill`` (left padding)."""
    index = end[:, None] - width + torch.arange(width, device=items.device)[None, :]
    picked = torch.gather(items, 1, index.clamp_min(0))
    return picked.masked_fill(index < 0, fill)


def leave_one_out(data: Interactions, max_len: int) -> LeaveOneOut:
    """Split every user (length >= 3) as described in ``LeaveOneOut``, windows of ``max_len``."""
    if bool((data.lengths < 3).any()):
        raise ValueError("leave-one-out needs at least 3 items per user")
    n = data.lengths
    train_ids = recent_window(data.items, n - 3, max_len, PAD)
    train_targets = recent_window(data.items, n - 2, max_len, IGNORE)
    train_targets = train_targets.masked_fill(train_ids == PAD, IGNORE)
    rows = torch.arange(len(n))
    return LeaveOneOut(
        train_ids=train_ids,
        train_targets=train_targets,
        valid_ids=recent_window(data.items, n - 2, max_len, PAD),
        valid_target=data.items[rows, n - 2],
        test_ids=recent_window(data.items, n - 1, max_len, PAD),
        test_target=data.items[rows, n - 1],
    )


def item_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``ids: [N, L]`` -> ``[vocab_size]`` int64 occurrence counts (pad count set to 0): the
    MostPop scores of the training data."""
    counts = torch.bincount(ids.flatten(), minlength=vocab_size)
    counts[PAD] = 0
    return counts


__all__ = [
    "Interactions",
    "LeaveOneOut",
    "SyntheticConfig",
    "generate_interactions",
    "item_counts",
    "leave_one_out",
    "recent_window",
]
