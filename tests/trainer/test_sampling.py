"""Poisson sampling: batch sizes follow Binomial(N, q), draws are independent of the sample id,
seeded draws repeat, rank shards partition the global draw, virtual batches cover it."""

import itertools

import pytest
import torch
from scipy import stats

from vllm_dp_plugin.trainer.sampling import PoissonSampler, shard_for_rank, virtual_batches

N, RATE, STEPS = 200, 0.05, 2000


def test_batch_sizes_are_binomial():
    """Chi-square goodness of fit of 2000 batch sizes to Binomial(200, 0.05) (bins pooled so
    every expected count is >= 5); a fixed-size or Bernoulli(q)-per-step sampler fails it."""
    sizes = torch.tensor([len(b) for b in PoissonSampler(N, RATE, STEPS, seed=0)])
    edges = [0, *range(4, 19), N + 1]  # bins [edges[k], edges[k+1]): tails pooled
    observed = [int(((sizes >= lo) & (sizes < hi)).sum()) for lo, hi in itertools.pairwise(edges)]
    cdf = stats.binom(N, RATE).cdf
    expected = [STEPS * (cdf(hi - 1) - cdf(lo - 1)) for lo, hi in itertools.pairwise(edges)]
    assert min(expected) >= 5
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_every_sample_is_drawn_at_the_rate():
    """Inclusion counts per sample ~ Binomial(STEPS, q): a sampler favouring low or high ids
    (e.g. a contiguous window) fails this KS test against the normal approximation."""
    counts = torch.zeros(N)
    for batch in PoissonSampler(N, RATE, STEPS, seed=1):
        counts[batch] += 1
    mean, std = STEPS * RATE, (STEPS * RATE * (1 - RATE)) ** 0.5
    assert stats.kstest(((counts - mean) / std).numpy(), "norm").pvalue > 1e-3


def test_seeded_draws_repeat_and_batches_are_sorted_int64():
    first = list(PoissonSampler(N, RATE, 5, seed=3))
    assert all(b.dtype == torch.int64 for b in first)
    assert all(torch.equal(b, b.sort().values) for b in first)
    assert all(torch.equal(a, b) for a, b in zip(first, PoissonSampler(N, RATE, 5, seed=3)))
    assert len(PoissonSampler(N, RATE, 5, seed=3)) == 5


def test_shards_partition_the_global_draw():
    batch = next(iter(PoissonSampler(N, 0.3, 1, seed=4)))
    shards = [shard_for_rank(batch, rank, 3) for rank in range(3)]
    assert sum(len(s) for s in shards) == len(batch)
    assert torch.equal(torch.cat(shards).sort().values, batch)


def test_virtual_batches_cover_in_order():
    batch = torch.arange(10)
    parts = virtual_batches(batch, 4)
    assert [len(p) for p in parts] == [4, 4, 2]
    assert torch.equal(torch.cat(parts), batch)
    assert virtual_batches(torch.arange(0), 4) == []


@pytest.mark.parametrize(
    "call",
    [
        lambda: PoissonSampler(0, 0.1, 1),
        lambda: PoissonSampler(10, 0.0, 1),
        lambda: PoissonSampler(10, 1.5, 1),
        lambda: PoissonSampler(10, 0.1, 0),
        lambda: shard_for_rank(torch.arange(3), 2, 2),
        lambda: virtual_batches(torch.arange(3), 0),
    ],
)
def test_bad_input_raises(call):
    with pytest.raises(ValueError):
        call()
