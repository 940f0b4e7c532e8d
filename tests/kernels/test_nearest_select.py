"""The fused CPU selection step of the certified nearest-candidate search equals its torch
reference (``prompt.nearest.select_within_bound``): the window is [min score, min score + slack],
the re-rank inside it is by float64 direct distance, exact ties go to the lowest position, and the
whole certified search equals float64 brute force."""

import pytest
import torch

from vllm_dp_plugin.kernels.nearest_reference import direct_distances, select_within_bound
from vllm_dp_plugin.kernels.nearest_select import _extension, default_select
from vllm_dp_plugin.kernels.nearest_select import select_within_bound as select_fused
from vllm_dp_plugin.prompt import CandidateIndex, brute_force_nearest

pytestmark = pytest.mark.skipif(_extension() is None, reason="no C++ toolchain for the CPU kernel")

SELECTS = [select_within_bound, select_fused]


def _problem(seed: int, n: int = 200, k: int = 300, d: int = 24):
    g = torch.Generator().manual_seed(seed)
    rows, queries = torch.randn(k, d, generator=g), torch.randn(n, d, generator=g)
    scores = torch.randn(n, k, generator=g)  # arbitrary: the windows are what matters here
    slack = 2.0 * torch.rand(n, generator=g)  # windows of 0 to ~half the rows
    return scores, slack, queries, rows


def _window_nearest(scores, slack, queries, rows):
    """Python reference: per query, the nearest (float64) row of its window; ties -> lowest."""
    out = []
    for i in range(scores.shape[0]):
        window = torch.nonzero(scores[i] <= scores[i].min() + slack[i]).squeeze(1)
        dist = direct_distances(rows[window], queries[i])
        out.append(int(window[dist == dist.min()].min()))
    return torch.tensor(out)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("select", SELECTS, ids=["torch", "fused"])
def test_nearest_of_the_window_not_the_best_score(select, seed):
    problem = _problem(seed)
    got = select(*problem)
    assert torch.equal(got, _window_nearest(*problem))
    assert (got != problem[0].argmin(1)).float().mean() > 0.5  # the re-rank decides, not the score


@pytest.mark.parametrize("select", SELECTS, ids=["torch", "fused"])
def test_rows_outside_the_window_are_never_chosen(select):
    """Row 1 is the nearest by distance but its score is above the window: row 0 is returned."""
    rows = torch.tensor([[5.0, 0.0], [0.0, 0.0], [9.0, 9.0]])
    queries = torch.zeros(3, 2)
    scores = torch.tensor([[0.0, 1.0, 0.5]]).repeat(3, 1)
    slack = torch.tensor([0.9, 1.0, 0.0])  # 1.0: the window closes on row 1's score exactly
    assert select(scores, slack, queries, rows).tolist() == [0, 1, 0]


@pytest.mark.parametrize("select", SELECTS, ids=["torch", "fused"])
def test_exact_ties_go_to_the_lowest_position(select):
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(130, 8, generator=g)
    rows[[70, 129]] = rows[5].clone()  # three copies, across the fused kernel's 64-score blocks
    queries = rows[5:6].repeat(4, 1) + 0.01 * torch.randn(4, 8, generator=g)
    scores = torch.zeros(4, 130)
    assert select(scores, torch.zeros(4), queries, rows).tolist() == [5] * 4


@pytest.mark.parametrize("select", SELECTS, ids=["torch", "fused"])
def test_non_finite_scores_are_refused(select):
    scores, slack, queries, rows = _problem(4, n=3)
    scores[1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        select(scores, slack, queries, rows)


@pytest.mark.parametrize("seed", [0, 1])
def test_certified_search_with_the_fused_select_equals_brute_force(seed):
    """Duplicated rows (exact ties), near ties and far queries through ``CandidateIndex``."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(300, 40, generator=g)
    rows[100:110] = rows[50:60]
    rows[200] = rows[20] + 1e-6 * torch.randn(40, generator=g)
    queries = torch.cat([
        rows[torch.randint(0, 300, (64,), generator=g)] + 0.05 * torch.randn(64, 40, generator=g),
        rows[50:60] + 0.0,
        rows[20:21] + 5e-7 * torch.randn(1, 40, generator=g),
        30.0 * torch.randn(16, 40, generator=g),
    ])
    ids = torch.arange(300) * 2 + 1
    index = CandidateIndex.build(ids, rows)
    got = index.nearest(queries, chunk=32, select=select_fused)
    assert torch.equal(got, ids[brute_force_nearest(queries, rows)])
    assert torch.equal(got, index.nearest(queries, chunk=32))  # the torch select agrees


def test_default_select_is_the_fused_kernel_on_cpu_only():
    assert default_select("cpu") is select_fused
    assert default_select("meta") is select_within_bound
