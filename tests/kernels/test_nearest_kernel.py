"""Nearest-candidate fast pass: the Triton kernel == the torch reference (as top-k sets).

Where the kernel tests run (natively on CUDA, or on CPU tensors in the ``TRITON_INTERPRET=1``
subprocess of ``test_kernel_tests_under_interpreter``) is ``conftest.py``'s. Tests that need no
kernel launch (validation, dispatch) run in both processes.

A returned top-k is checked against scores, never against a hard-coded answer: every position
whose score is below the k-th smallest must be in it, and nothing in it may score above the k-th
smallest (so any member of a tie at the boundary is accepted).
"""

import pytest
import torch

from vllm_dp_plugin.kernels import nearest as kn
from vllm_dp_plugin.kernels.nearest_reference import fast_topk_torch
from vllm_dp_plugin.prompt import EmbeddingTable, TokenPrivatizer, token_mechanism
from vllm_dp_plugin.prompt.nearest import CandidateIndex, brute_force_nearest

F64 = torch.float64
K_TOP = 32


def test_kernel_tests_under_interpreter(interpreter_run):
    """This file's kernel tests, in a fresh process under triton's CPU interpreter: every test but
    this launcher ran there (a kernel test skipped there would hide a failure)."""
    passed, skipped, tail = interpreter_run(__file__)
    assert passed >= 15 and skipped == 1, tail


def gen(seed):
    return torch.Generator().manual_seed(seed)


def scores64(queries, rows):
    """float64 ``||e||^2 - 2 <e, q>`` ``[n, K]`` of the given (already rounded) inputs."""
    q, e = queries.to(F64), rows.to(F64)
    return e.pow(2).sum(-1)[None, :] - 2.0 * q @ e.T


def assert_valid_topk(top, scores, k, tol=0.0):
    """``top [n, k]`` is a k-smallest set of every row of ``scores [n, K]``, ties at the boundary
    (within ``tol``) resolved either way; positions distinct and in range."""
    n, K = scores.shape
    assert top.shape == (n, k) and top.dtype == torch.int64
    assert int(top.min()) >= 0 and int(top.max()) < K
    assert all(len(set(row.tolist())) == k for row in top.cpu())
    kth = scores.sort(dim=1).values[:, k - 1 : k]  # [n, 1]
    chosen = scores.gather(1, top)
    assert bool((chosen <= kth + tol).all()), "a member scores above the k-th smallest"
    member = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)
    assert bool(member[scores < kth - tol].all()), "a candidate below the k-th is missing"


def clear_boundary(scores, k, gap):
    """Rows whose k-th and (k+1)-th smallest scores differ by more than ``gap``: ``[n]`` bool."""
    s = scores.sort(dim=1).values
    return (s[:, k] - s[:, k - 1]) > gap


def inputs(n, K, d, seed, near=True):
    """fp32 candidate rows ``[K, d]``, their ``sq_norms`` and queries ``[n, d]``: noisy copies
    of random rows (``near``) or independent Gaussians."""
    g = gen(seed)
    rows = torch.randn(K, d, generator=g)
    if near:
        picks = torch.randint(0, K, (n,), generator=g)
        queries = rows[picks] + 0.5 * torch.randn(n, d, generator=g)
    else:
        queries = torch.randn(n, d, generator=g)
    return rows, rows.pow(2).sum(-1), queries


def on(device, *tensors):
    return [t.to(device) for t in tensors]


# ---------------------------------------------------------------- fp32: same sets as torch


@pytest.mark.parametrize(
    ("n", "K", "d", "k", "near"),
    [
        (70, 300, 40, K_TOP, True),  # 2 query blocks (BLOCK_N = 64), K % 64 != 0, d not 2^m
        (9, 130, 384, K_TOP, False),  # d = 384 (6 d-steps of 64)
        (1, 65, 16, K_TOP, True),  # n = 1, K = one tile + 1
        (20, 100, 24, 5, False),  # k not a power of two
        (12, 40, 8, 40, True),  # k = K (every position, sorted)
        (12, 90, 20, 1, True),  # k = 1
    ],
)
def test_fp32_topk_set_equals_reference(kernel_device, n, K, d, k, near):
    rows, sq, queries = on(kernel_device, *inputs(n, K, d, seed=n * K + d, near=near))
    top = kn.fast_topk_triton(queries, rows, sq, k)
    ref = kn.fast_topk_reference(queries, rows, sq, k)
    exact = scores64(queries, rows)
    tol = 1e-4 * float(exact.abs().max())  # fp32 GEMM rounding of either implementation
    assert_valid_topk(top, exact, k, tol)
    clear = clear_boundary(exact, k, 2 * tol) if k < K else torch.ones(n, dtype=torch.bool)
    assert int(clear.sum()) >= max(1, n // 2)  # the set comparison below is not vacuous
    for row in clear.nonzero().squeeze(1).tolist():
        assert set(top[row].tolist()) == set(ref[row].tolist()), row
    # sorted by score within each row
    own = exact.gather(1, top)
    assert bool((own[:, 1:] >= own[:, :-1] - tol).all())


def test_exact_ties_duplicate_rows(kernel_device):
    """Integer data (every fp32 score exact) with each row repeated: the result is exactly the k
    smallest (score, position) pairs in that order, i.e. boundary ties go to the lowest position;
    the torch reference is a valid (tie-agnostic) top-k of the same scores."""
    g = gen(7)
    distinct = torch.randint(-3, 4, (23, 24), generator=g).float()
    rows = distinct[torch.randint(0, 23, (211,), generator=g)]  # 211 rows, ~9 copies of each
    queries = torch.randint(-3, 4, (66, 24), generator=g).float()
    queries[:10] = rows[:10]  # queries sitting exactly on a duplicated row
    rows, queries = on(kernel_device, rows, queries)
    sq = rows.pow(2).sum(-1)
    top = kn.fast_topk_triton(queries, rows, sq, K_TOP)
    exact = scores64(queries, rows)
    tied_at_boundary = (exact == exact.sort(dim=1).values[:, K_TOP - 1 : K_TOP]).sum(1) > 1
    assert int(tied_at_boundary.sum()) >= 30  # the data really has boundary ties
    positions = torch.arange(rows.shape[0], device=exact.device, dtype=F64)
    lexi = (exact * rows.shape[0] + positions).argsort(dim=1)[:, :K_TOP]  # (score, position)
    assert torch.equal(top, lexi)
    assert_valid_topk(kn.fast_topk_reference(queries, rows, sq, K_TOP), exact, K_TOP)
    assert_valid_topk(top, exact, K_TOP)


def test_negative_and_zero_scores_order(kernel_device):
    """Scores of both signs and exact zeros: the int64 key order is the float order."""
    rows = torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0], [-1.0, 0.0], [0.5, 0.0], [3.0, 0.0]])
    rows = rows.repeat_interleave(8, dim=1)[:, :16]  # d = 16
    queries = torch.tensor([[1.0] * 16, [0.0] * 16, [-0.25] * 16])
    rows, queries = on(kernel_device, rows, queries)
    sq = rows.pow(2).sum(-1)
    top = kn.fast_topk_triton(queries, rows, sq, 6)
    exact = scores64(queries, rows)
    positions = torch.arange(rows.shape[0], device=exact.device, dtype=F64)
    assert torch.equal(top, (exact * 64 + positions).argsort(dim=1))


# ---------------------------------------------------------------- bf16 candidate pass


def test_bf16_top32_contains_exact_nearest(kernel_device):
    rows, sq, queries = on(kernel_device, *inputs(120, 400, 64, seed=11))
    fast = rows.to(torch.bfloat16)
    top = kn.fast_topk_triton(queries, fast, sq, K_TOP)
    nearest = brute_force_nearest(queries.cpu(), rows.cpu()).to(kernel_device)
    assert bool((top == nearest[:, None]).any(dim=1).all())
    # and it is the top-32 of the bf16-rounded inputs with fp32 accumulate (not torch's
    # bf16-rounded dot products): valid against the exact scores of those inputs
    q16 = queries.to(torch.bfloat16)
    exact = sq.to(F64)[None, :] - 2.0 * q16.to(F64) @ fast.to(F64).T
    assert_valid_topk(top, exact, K_TOP, tol=1e-4 * float(exact.abs().max()))


@pytest.mark.parametrize("fast_dtype", [torch.float32, torch.bfloat16])
def test_candidate_index_with_triton_equals_brute_force(kernel_device, fast_dtype):
    rows, _, queries = inputs(150, 260, 40, seed=3)
    rows[200:230] = rows[100:130]  # exact duplicates: ties must go to the lowest id
    queries[:20] = rows[200:220] + 1e-3  # nearest to a duplicated row
    ids = torch.arange(260, dtype=torch.int64) * 3 + 5  # sorted, not 0..K-1
    index = CandidateIndex.build(ids.to(kernel_device), rows.to(kernel_device), fast_dtype)
    got = index.nearest(queries.to(kernel_device), k=K_TOP, chunk=64, fast_pass=kn.fast_topk_triton)
    want = ids[brute_force_nearest(queries, rows)]
    assert torch.equal(got.cpu(), want)
    assert bool((got.cpu()[:20] == ids[100:120]).all())


def test_privatizer_with_triton_fast_pass_matches_torch(kernel_device):
    """Same generator state: identical releases whichever fast pass is plugged in."""
    gen_rows = gen(5)
    emb = torch.randn(212, 32, generator=gen_rows) * torch.linspace(0.3, 2.0, 32) + 0.5
    table = EmbeddingTable.build(emb.to(kernel_device), 200, (0, 1, 2, 3))
    mech = token_mechanism("trlap_corrected", table, 10.0, 1e-6)
    ids = torch.randint(0, 200, (90,), generator=gen(6)).to(kernel_device)
    mask = torch.ones(90, dtype=torch.bool, device=kernel_device)
    mask[:5] = False
    out = {}
    for name, fast_pass in (("torch", fast_topk_torch), ("triton", kn.fast_topk_triton)):
        priv = TokenPrivatizer(table, mech, fast_pass=fast_pass)
        noise = torch.Generator(device=kernel_device).manual_seed(123)
        out[name], receipt = priv.privatize(ids, mask, noise)
        assert receipt.tokens_privatized == 85
    assert torch.equal(out["torch"], out["triton"])
    assert not torch.equal(out["triton"][5:], ids[5:])  # eps 10 at d = 32 does move tokens


# ---------------------------------------------------------------- edge cases and dispatch


def test_large_k_falls_back_to_torch(kernel_device):
    rows, sq, queries = on(kernel_device, *inputs(6, 200, 16, seed=2))
    k = kn.MAX_TOPK + 5
    top = kn.fast_topk_triton(queries, rows, sq, k)
    assert_valid_topk(top, scores64(queries, rows), k, tol=1e-4)


def test_empty_queries_and_bad_arguments():
    """No launch needed: runs in both processes."""
    rows, sq, queries = inputs(4, 50, 40, seed=1)
    for fn in (kn.fast_topk_triton, kn.fast_topk_reference):
        with pytest.raises(ValueError, match="k must be an int in"):
            fn(queries, rows, sq, 51)  # k > K
        with pytest.raises(ValueError, match="k must be an int in"):
            fn(queries, rows, sq, 0)
        with pytest.raises(ValueError, match="fast_rows must be float32 or bfloat16"):
            fn(queries, rows.half(), sq, 3)
        with pytest.raises(ValueError, match="need queries"):
            fn(queries[:, :39], rows, sq, 3)
        with pytest.raises(ValueError, match="sq_norms"):
            fn(queries, rows, sq[:-1], 3)
    assert kn.fast_topk_reference(queries[:0], rows, sq, 3).shape == (0, 3)


def test_empty_queries(kernel_device):
    rows, sq, queries = on(kernel_device, *inputs(4, 50, 40, seed=1))
    for dtype in (torch.float32, torch.bfloat16):
        empty = kn.fast_topk_triton(queries[:0], rows.to(dtype), sq, K_TOP)
        assert empty.shape == (0, K_TOP) and empty.dtype == torch.int64


def test_triton_on_cpu_tensors_needs_the_interpreter():
    pytest.importorskip("triton")
    rows, sq, queries = inputs(3, 80, 16, seed=4)
    if kn.interpret_requested():
        assert kn.fast_topk_triton(queries, rows, sq, 4).shape == (3, 4)
    else:
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            kn.fast_topk_triton(queries, rows, sq, 4)


def test_default_fast_pass(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kn.default_fast_pass("cpu") is fast_topk_torch
    assert kn.default_fast_pass(torch.device("cuda", 0)) is kn.fast_topk_triton
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kn.default_fast_pass("cpu") is kn.fast_topk_triton
    monkeypatch.setattr(kn, "triton_available", lambda: False)
    assert kn.default_fast_pass("cuda") is fast_topk_torch
