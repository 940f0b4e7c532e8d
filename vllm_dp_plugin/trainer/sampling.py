"""Poisson subsampling of training samples, the sampling the RDP/PLD analysis of
``accounting.py`` assumes: every sample is in a step's batch independently with probability
``sample_rate``, so batch sizes vary (Binomial(N, q)) and may be 0.

Under torch.distributed every rank builds the sampler with the same seed, draws the same global
batch, and keeps its ``shard_for_rank``; ``virtual_batches`` splits a (shard of a) batch into
physical batches that fit in memory, all accumulated into one noisy step by the engine.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import torch

from vllm_dp_plugin.privacy.validation import check_count, check_positive


class PoissonSampler:
    """``steps`` Poisson draws over ``range(num_samples)`` at rate ``sample_rate``.

    Each iteration yields, per step, the sorted int64 indices of the sampled examples (possibly
    empty). ``seed`` makes the draws reproducible (tests; the shared draw of every DDP rank); it
    must then be kept secret like the noise seed. ``None`` seeds from OS entropy, and every
    ``iter()`` restarts from the same seed, so the sequence of batches is fixed per sampler."""

    def __init__(self, num_samples: int, sample_rate: float, steps: int, seed: int | None = None):
        self.num_samples = check_count(num_samples, "num_samples")
        rate = check_positive(sample_rate, "sample_rate")
        if rate > 1:
            raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate!r}")
        self.sample_rate = rate
        self.steps = check_count(steps, "steps")
        self.seed = secrets.randbits(63) if seed is None else seed

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(self.steps):
            chosen = torch.rand(self.num_samples, generator=generator, dtype=torch.float64) < self.sample_rate
            yield chosen.nonzero().flatten()


def shard_for_rank(indices: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's share ``indices[rank::world_size]`` of a global batch ``indices: [n]``; the
    shards of ranks ``0..world_size-1`` partition ``indices``."""
    check_count(world_size, "world_size")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    return indices[rank::world_size]


def virtual_batches(indices: torch.Tensor, max_physical: int) -> list[torch.Tensor]:
    """Consecutive chunks of ``indices: [n]`` of at most ``max_physical`` each (none for n = 0)."""
    size = check_count(max_physical, "max_physical")
    return list(torch.split(indices, size)) if len(indices) else []
