"""Nearest-candidate search: certified fp32 and int8 passes, bf16 top-k + exact re-rank == brute force."""

import pytest
import torch

from vllm_dp_plugin.kernels.nearest_reference import squared_distance_scores
from vllm_dp_plugin.prompt import CandidateIndex, brute_force_nearest

K, D = 1000, 32


def random_rows(seed: int, k: int = K, d: int = D) -> torch.Tensor:
    return torch.randn(k, d, generator=torch.Generator().manual_seed(seed))


def noisy_queries(rows: torch.Tensor, n: int, scale: float, seed: int) -> torch.Tensor:
    """n queries near random rows (scale = noise std relative to a unit coordinate)."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, rows.shape[0], (n,), generator=gen)
    return rows[picks].double() + scale * torch.randn(
        n, rows.shape[1], generator=gen, dtype=torch.float64
    )


@pytest.mark.parametrize("fast_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("scale", [0.3, 3.0])
def test_fast_path_equals_brute_force_on_random_tables(fast_dtype, scale):
    rows = random_rows(0)
    ids = torch.arange(K) * 3 + 7  # non-contiguous candidate ids
    index = CandidateIndex.build(ids, rows, fast_dtype)
    queries = noisy_queries(rows, 500, scale, seed=1)
    got = index.nearest(queries, k=16, chunk=128)  # several chunks, one partial
    assert torch.equal(got, ids[brute_force_nearest(queries, rows)])


@pytest.mark.parametrize("fast_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_exact_ties_go_to_the_lowest_id(fast_dtype):
    """Duplicated rows tie exactly in every precision; both paths must return the lowest id."""
    rows = random_rows(2)
    groups = [(3, 10, 500), (40, 41), (900, 7, 999, 64)]
    for group in groups:
        for member in group[1:]:
            rows[member] = rows[group[0]]
    index = CandidateIndex.build(torch.arange(K), rows, fast_dtype)
    gen = torch.Generator().manual_seed(4)
    anchors = torch.tensor([g[0] for g in groups]).repeat_interleave(50)
    queries = rows[anchors].double() + 0.05 * torch.randn(
        len(anchors), D, generator=gen, dtype=torch.float64
    )
    expected = torch.tensor([min(g) for g in groups]).repeat_interleave(50)
    assert torch.equal(brute_force_nearest(queries, rows), expected)
    assert torch.equal(index.nearest(queries, k=8, chunk=64), expected)


def test_rerank_fixes_bf16_near_ties():
    """Queries almost equidistant from two rows: bf16 scores alone pick the wrong row for some,
    the exact float64 re-rank of the bf16 top-k recovers brute force on all."""
    rows = random_rows(5, k=400, d=64) * 4.0
    gen = torch.Generator().manual_seed(6)
    a, b = torch.randint(0, 400, (2, 2000), generator=gen)
    keep = a != b
    t = 0.5 + 1e-3 * torch.randn(int(keep.sum()), 1, generator=gen)
    queries = rows[a[keep]] * t + rows[b[keep]] * (1 - t)
    index = CandidateIndex.build(torch.arange(400), rows, torch.bfloat16)
    expected = brute_force_nearest(queries, rows)
    bf16_only = squared_distance_scores(queries, index.fast_rows, index.sq_norms).argmin(1)
    assert (bf16_only != expected).sum() >= 10  # the check below is not vacuous
    assert torch.equal(index.nearest(queries, k=32), expected)


def test_empty_queries_and_bad_dtype():
    index = CandidateIndex.build(torch.arange(10), random_rows(0, k=10))
    assert index.nearest(torch.empty(0, D)).shape == (0,)
    with pytest.raises(ValueError, match="fast_dtype"):
        CandidateIndex.build(torch.arange(10), random_rows(0, k=10), torch.float16)


@pytest.mark.parametrize("seed", [0, 1])
def test_certified_fp32_pass_equals_the_direct_rerank_over_every_row(seed):
    """The window of rows within the GEMM error bound always holds the row the direct fp32
    re-rank over ALL rows picks: duplicated rows (exact ties), near ties and far queries."""
    from vllm_dp_plugin.prompt.nearest import certified_nearest_fp32, rerank_exact

    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(300, 40, generator=g)
    rows[100:110] = rows[50:60]  # exact duplicates: ties go to the lower position
    rows[200] = rows[20] + 1e-6 * torch.randn(40, generator=g)  # near ties
    queries = torch.cat([
        rows[torch.randint(0, 300, (64,), generator=g)] + 0.05 * torch.randn(64, 40, generator=g),
        rows[50:60] + 0.0,  # exactly on a duplicated row
        rows[20:21] + 5e-7 * torch.randn(1, 40, generator=g),
        30.0 * torch.randn(16, 40, generator=g),  # far from everything
    ])
    sq = rows.pow(2).sum(-1)
    every = torch.arange(300).expand(queries.shape[0], -1)
    got = certified_nearest_fp32(queries, rows, sq)
    assert torch.equal(got, rerank_exact(queries, rows, every))
    assert bool((got[64:74] == torch.arange(50, 60)).all())  # the lower of each duplicate pair
