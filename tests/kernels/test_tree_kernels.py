"""Triton DPTree kernels == their torch references.

Where the kernel tests run (natively on CUDA, or on CPU tensors in the ``TRITON_INTERPRET=1``
subprocess of ``test_kernels_under_interpreter``) is ``conftest.py``'s. In both, the torch
references are swapped for a function that fails, so a passing test proves the dispatcher ran the
Triton path.
"""

import pytest
import torch

from vllm_dp_plugin.kernels import tree_build, tree_query

F64 = torch.float64


@pytest.fixture
def kernels(kernel_device, monkeypatch):
    """(device, torch references); the dispatchers may not fall back to torch."""

    def forbidden(*args, **kwargs):
        raise AssertionError("dispatcher fell back to the torch reference")

    refs = {"leaf": tree_build.leaf_histogram_torch, "query": tree_query.gather_contract_torch}
    monkeypatch.setattr(tree_build, "leaf_histogram_torch", forbidden)
    monkeypatch.setattr(tree_query, "gather_contract_torch", forbidden)
    return kernel_device, refs


def test_kernels_under_interpreter(interpreter_run):
    """This file's kernel tests, in a fresh process under triton's CPU interpreter."""
    passed, skipped, tail = interpreter_run(__file__)
    assert passed and skipped == 1, tail


def gen(seed):
    return torch.Generator().manual_seed(seed)


def histogram_inputs(n, F, W, N, seed, batch=None):
    """Random rows incl. u = lo, u = hi and values exactly on interior bin edges."""
    g = gen(seed)
    lo = torch.tensor([0.0, -1.0, -1.5, 0.25, -2.0, 0.0, -0.75][:F], dtype=F64)
    hi = torch.tensor([1.0, 1.0, 2.5, 1.25, 2.0, 3.0, 0.25][:F], dtype=F64)
    lead = () if batch is None else (batch,)
    pk = lo + (hi - lo) * torch.rand(*lead, n, F, generator=g, dtype=F64)
    edges = lo + (hi - lo) * torch.randint(0, N + 1, (*lead, n, F), generator=g).to(F64) / N
    on_edge = torch.rand(*lead, n, F, generator=g) < 0.4
    pk = torch.where(on_edge, edges, pk)
    pk[..., 0, :] = lo
    pk[..., -1, :] = hi
    weights = torch.randn(*lead, n, W, generator=g, dtype=F64)
    return pk, weights, lo, hi


def test_bin_index_edges():
    lo, hi, N = torch.tensor([-1.5], dtype=F64), torch.tensor([2.5], dtype=F64), 8
    edges = lo + (hi - lo) * torch.arange(N + 1, dtype=F64)[:, None] / N  # exact in binary
    bins = tree_build.bin_index(edges, lo, hi, N)[:, 0]
    assert bins.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 7]  # u = hi joins the last leaf
    below, above = tree_build.bin_index(torch.tensor([[-9.0], [9.0]], dtype=F64), lo, hi, N)
    assert (int(below), int(above)) == (0, N - 1)


def test_dispatcher_rule(monkeypatch):
    x = torch.zeros(2, dtype=F64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert tree_build.backend_for(x) == "torch"  # CPU tensor, no interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    expected = "triton" if tree_build.triton_available() else "torch"
    assert tree_build.backend_for(x) == expected


@pytest.mark.parametrize(
    "n, F, W, N, batch",
    [(37, 5, 7, 8, None), (1, 1, 1, 2, None), (130, 3, 67, 16, None), (45, 7, 3, 32, 3)],
)
def test_leaf_histogram_triton_matches_torch(kernels, n, F, W, N, batch):
    device, refs = kernels
    pk, weights, lo, hi = histogram_inputs(n, F, W, N, seed=n + F, batch=batch)
    expected = refs["leaf"](pk, weights, lo, hi, N)
    pk_d, weights_d = pk.to(device), weights.to(device)
    assert tree_build.backend_for(pk_d) == "triton"
    got = tree_build.leaf_histogram(pk_d, weights_d, lo.to(device), hi.to(device), N).cpu()
    lead = () if batch is None else (batch,)
    assert got.shape == expected.shape == (*lead, F, N, 3, W) and got.dtype == F64
    # same bins exactly (a row in the wrong leaf moves a whole weight), sums up to rounding
    assert torch.equal(got[..., 0, :] != 0, expected[..., 0, :] != 0)
    magnitude = n * float(weights.abs().max()) * float((pk.abs() + 1).pow(2).max())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-14 * magnitude)
    # every row lands in exactly one leaf per tree: moment-0 leaf totals are the column sums
    totals = got[..., 0, :].sum(-2)  # [(B,) F, W]
    torch.testing.assert_close(totals, weights.sum(-2)[..., None, :].expand_as(totals))


def test_leaf_histogram_triton_strided_inputs(kernels):
    device, refs = kernels
    pk, weights, lo, hi = histogram_inputs(29, 4, 5, 8, seed=3)
    expected = refs["leaf"](pk, weights, lo, hi, 8)
    pk_t = pk.t().contiguous().t().to(device)  # column-major [n, F]
    w_t = weights.t().contiguous().t().to(device)
    got = tree_build.leaf_histogram(pk_t, w_t, lo.to(device), hi.to(device), 8).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize(
    "F, N, C, W, m, dtype, batch",
    [
        (37, 8, 3, 5, 11, F64, None),
        (5, 16, 1, 65, 4, torch.float32, None),
        (3, 2, 1, 1, 1, F64, None),
        (6, 4, 3, 2, 5, torch.float32, 2),
    ],
)
def test_gather_contract_triton_matches_torch(kernels, F, N, C, W, m, dtype, batch):
    device, refs = kernels
    g = gen(F * N + m)
    lead = () if batch is None else (batch,)
    table = torch.randn(*lead, F, N, C * 3 * W, generator=g, dtype=F64).mul_(100).to(dtype)
    bins = torch.randint(0, N, (*lead, m, F), generator=g)
    bins[..., 0, :] = N - 1
    bins[..., -1, 0] = 0
    values = torch.randn(*lead, m, F, generator=g, dtype=F64)
    expected = refs["query"](table, bins, values, C)
    table_d = table.to(device)
    assert tree_query.backend_for(table_d) == "triton"
    got = tree_query.gather_contract(table_d, bins.to(device), values.to(device), C).cpu()
    assert got.shape == expected.shape == (*lead, m, C, W) and got.dtype == F64
    # |sum_f v^2 t0 - 2 v t1 + t2| <= F max|t| max(v^2 + 2|v| + 1): the scale of rounding errors
    magnitude = F * float(table.abs().max()) * float((values.abs() + 1).pow(2).max())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-14 * magnitude)


def test_gather_contract_reference_formula():
    """The torch reference itself against a loop over f of y^2 S0 - 2 y S1 + S2."""
    g = gen(7)
    F, N, C, W, m = 4, 8, 3, 2, 3
    table = torch.randn(F, N, C * 3 * W, generator=g, dtype=F64)
    bins = torch.randint(0, N, (m, F), generator=g)
    values = torch.randn(m, F, generator=g, dtype=F64)
    got = tree_query.gather_contract_torch(table, bins, values, C)
    ps = table.view(F, N, C, 3, W)
    for i in range(m):
        want = sum(
            values[i, f] ** 2 * ps[f, bins[i, f], :, 0]
            - 2 * values[i, f] * ps[f, bins[i, f], :, 1]
            + ps[f, bins[i, f], :, 2]
            for f in range(F)
        )
        torch.testing.assert_close(got[i], want, rtol=1e-13, atol=1e-12)


def test_tree_release_same_on_both_backends(kernels, monkeypatch):
    """TreeRelease built and queried through the Triton kernels == through torch (CPU)."""
    from vllm_dp_plugin.attention.tree import TreeRelease
    from vllm_dp_plugin.attention.tree_spec import TreeSpec, sample_tree_noise
    from vllm_dp_plugin.privacy.accountant import Budget

    device, refs = kernels
    H, n, F, W, N, C, m = 2, 11, 3, 3, 8, 3, 4
    lo = torch.tensor([0.0, -1.0, 0.0], dtype=F64)
    hi = torch.tensor([1.0, 1.0, 2.0], dtype=F64)
    sens = 2.0 * torch.ones(W, F, 1, dtype=F64) * hi[None, :, None] ** torch.arange(3, dtype=F64)
    node = Budget(1.0, 1e-3)
    spec = TreeSpec(lo, hi, sens, 1.0, 2.0 * torch.ones(W, dtype=F64), N, C, node, node)
    g = gen(11)
    pk = lo + (hi - lo) * torch.rand(H, n, F, generator=g, dtype=F64)
    values = torch.rand(H, n, W - 1, generator=g, dtype=F64) * 2 - 1
    weights = torch.cat([values, torch.ones(H, n, 1, dtype=F64)], -1)
    pq = lo + (hi - lo) * torch.rand(H, m, F, generator=g, dtype=F64)
    noise = sample_tree_noise(spec, H, g)

    monkeypatch.setattr(tree_build, "leaf_histogram_torch", refs["leaf"])
    monkeypatch.setattr(tree_query, "gather_contract_torch", refs["query"])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert tree_build.backend_for(pk) == "torch"
    expected = TreeRelease.build(pk, weights, spec, g, noise, dtype=F64).answer(pq)

    monkeypatch.setattr(tree_build, "leaf_histogram_torch", None)  # triton or bust
    monkeypatch.setattr(tree_query, "gather_contract_torch", None)
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    pk_d = pk.to(device)
    assert tree_build.backend_for(pk_d) == "triton"
    release = TreeRelease.build(pk_d, weights.to(device), spec, g, noise, dtype=F64)
    got = release.answer(pq.to(device)).cpu()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10 * float(expected.abs().max()))
