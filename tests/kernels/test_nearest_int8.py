"""The certified int8 nearest-candidate pass (``prompt.nearest.certified_nearest_int8``): the
per-pair bound holds, the fused CPU selection equals its torch reference, and the search equals
float64 brute force (exact ties, near ties, far and zero queries, 10,240 noisy queries), also on
oneDNN's AVX2 path, whose int8 GEMM saturates full-range row codes."""

import os
import subprocess
import sys

import pytest
import torch

from vllm_dp_plugin.kernels.nearest_reference import select_int8 as select_torch
from vllm_dp_plugin.kernels.nearest_select import _extension, default_select_int8
from vllm_dp_plugin.kernels.nearest_select import select_int8 as select_fused
from vllm_dp_plugin.kernels.types import Int8Rows
from vllm_dp_plugin.prompt import CandidateIndex, brute_force_nearest
from vllm_dp_plugin.prompt.nearest import (
    INT8_MARGIN,
    certified_nearest_int8,
    quantize_int8,
    row_code_max,
)

pytestmark = pytest.mark.skipif(_extension() is None, reason="no C++ toolchain for the CPU kernel")

SELECTS = [select_torch, select_fused]


def _rows(seed: int, k: int = 400, d: int = 48) -> torch.Tensor:
    """Rows of mixed scale: heavy-tailed coordinates, a zero row, duplicates and a near tie."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(k, d, generator=g) * torch.rand(k, 1, generator=g).mul(3).exp()
    rows[::37, 0] *= 40.0  # one large coordinate: a coarse scale for the rest of the row
    rows[7] = 0.0
    rows[100:110] = rows[50:60]
    rows[200] = rows[20] + 1e-6 * torch.randn(d, generator=g)
    return rows


def _queries(rows: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k, d = rows.shape
    near = rows[torch.randint(0, k, (256,), generator=g)]
    return torch.cat([
        near + 0.3 * near.abs().mean() * torch.randn(256, d, generator=g),
        rows[50:60] + 0.0,  # exactly on a duplicated row
        rows[20:21] + 5e-7 * torch.randn(1, d, generator=g),  # between a near tie
        (rows[3] + rows[4]) / 2 + 1e-5 * torch.randn(8, d, generator=g),  # midpoints
        300.0 * torch.randn(16, d, generator=g),  # far from everything
        torch.zeros(2, d),
    ]).float()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_per_pair_bound_holds(seed):
    """|c - exact| <= t for every (query, row), with c and t as the selection computes them."""
    rows = _rows(seed)
    queries = _queries(rows, seed + 10)
    r8, q8 = quantize_int8(rows, row_code_max()), quantize_int8(queries)
    gram = torch._int_mm(q8.codes, r8.codes.T).double()
    assert torch.equal(gram, q8.codes.double() @ r8.codes.double().T)  # exact integers
    score = r8.sq[None] - 2.0 * q8.scale[:, None] * r8.scale[None] * gram
    exact = r8.sq[None] - 2.0 * queries.double() @ rows.double().T
    slack = 2.0 * (r8.err[None] * q8.sq.sqrt()[:, None] + r8.coded_norm[None] * q8.err[:, None])
    bound = slack + INT8_MARGIN * (r8.sq[None] + q8.sq[:, None])
    assert bool(((score - exact).abs() <= bound).all())
    assert float(((score - exact).abs() / bound.clamp_min(1e-300)).max()) > 0.02  # loose, not vacuous


@pytest.mark.parametrize("seed", [0, 1])
def test_certified_int8_equals_brute_force(seed):
    rows = _rows(seed)
    queries = _queries(rows, seed + 20)
    ids = torch.arange(rows.shape[0]) * 3 + 1
    index = CandidateIndex.build(ids, rows, torch.int8)
    got = index.nearest(queries, chunk=100)  # several chunks, one partial
    assert torch.equal(got, ids[brute_force_nearest(queries, rows)])
    assert bool((got[256:266] == ids[50:60]).all())  # the lower of each duplicate pair


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_select_equals_the_torch_reference(seed):
    rows = _rows(seed, k=300)
    queries = _queries(rows, seed + 30)
    r8 = quantize_int8(rows, row_code_max())
    got = [certified_nearest_int8(queries, rows, r8, select) for select in SELECTS]
    assert torch.equal(got[0], got[1])


def test_the_rerank_decides_near_ties():
    """Queries almost equidistant from two rows: the int8 scores alone pick the wrong row for many,
    and without the bound (t = 0) the re-rank window misses the nearest row for some."""
    g = torch.Generator().manual_seed(6)
    rows = torch.randn(400, 64, generator=g) * 4.0
    a, b = torch.randint(0, 400, (2, 2000), generator=g)
    keep = a != b
    t = 0.5 + 1e-3 * torch.randn(int(keep.sum()), 1, generator=g)
    queries = rows[a[keep]] * t + rows[b[keep]] * (1 - t)
    expected = brute_force_nearest(queries, rows)
    r8, q8 = quantize_int8(rows, row_code_max()), quantize_int8(queries)
    gram = torch._int_mm(q8.codes, r8.codes.T).double()
    int8_only = (r8.sq[None] - 2.0 * q8.scale[:, None] * r8.scale[None] * gram).argmin(1)
    assert (int8_only != expected).sum() >= 50
    blind = Int8Rows(r8.codes, r8.scale, torch.zeros_like(r8.err), torch.zeros_like(r8.coded_norm), r8.sq)
    assert (certified_nearest_int8(queries, rows, blind, select_fused) != expected).sum() >= 10
    assert torch.equal(certified_nearest_int8(queries, rows, r8, select_fused), expected)


def test_ten_thousand_noisy_queries_equal_brute_force():
    """10,240 queries with Laplace noise (the additive mechanisms' regime: far from every row)."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(2000, 64, generator=g) * 0.05
    picks = torch.randint(0, 2000, (10240,), generator=g)
    noise = torch.distributions.Laplace(0.0, 0.2).sample((10240, 64))
    queries = (rows[picks] + noise).float()
    index = CandidateIndex.build(torch.arange(2000), rows, torch.int8)
    assert torch.equal(index.nearest(queries), brute_force_nearest(queries, rows))


@pytest.mark.parametrize("select", SELECTS, ids=["torch", "fused"])
def test_non_finite_queries_are_refused(select):
    rows = _rows(0, k=250)
    queries = _queries(rows, 1)[:4]
    queries[1, 3] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        certified_nearest_int8(queries, rows, quantize_int8(rows, row_code_max()), select)


def test_default_select_int8_is_the_fused_kernel_on_cpu_only():
    assert default_select_int8("cpu") is select_fused
    assert default_select_int8("meta") is select_torch


def test_the_gram_buffer_is_reused_per_thread_and_caps_the_chunk(monkeypatch):
    """A buffer of INT8_GRAM_BYTES caps the queries per GEMM (several chunks, one partial) and is
    reused by the next call; another thread gets its own."""
    import threading

    from vllm_dp_plugin.prompt import nearest

    rows = _rows(3)
    queries = _queries(rows, 40)
    monkeypatch.setattr(nearest, "INT8_GRAM_BYTES", 4 * rows.shape[0] * 37)  # 37 queries per GEMM
    index = CandidateIndex.build(torch.arange(rows.shape[0]), rows, torch.int8)
    expected = brute_force_nearest(queries, rows)
    assert torch.equal(index.nearest(queries), expected)
    buffer = index.scratch.gram
    assert buffer.numel() == 37 * rows.shape[0]
    assert torch.equal(index.nearest(queries[:5]), expected[:5]) and index.scratch.gram is buffer
    other = []
    thread = threading.Thread(target=lambda: other.append((index.nearest(queries), index.scratch.gram)))
    thread.start()
    thread.join()
    assert torch.equal(other[0][0], expected) and other[0][1] is not buffer


AVX2_CHECK = """
import torch
from vllm_dp_plugin.prompt import CandidateIndex, brute_force_nearest
from vllm_dp_plugin.prompt.nearest import int8_gemm_exact, row_code_max
g = torch.Generator().manual_seed(8)
rows = torch.randn(3000, 64, generator=g)
rows[::7, 0] *= 30.0
queries = (rows[torch.randint(0, 3000, (2048,), generator=g)] + torch.randn(2048, 64, generator=g)).float()
index = CandidateIndex.build(torch.arange(3000), rows, torch.int8)
print(int8_gemm_exact(127), row_code_max(), bool(torch.equal(index.nearest(queries), brute_force_nearest(queries, rows))))
"""


def test_on_onednns_avx2_path_full_range_rows_saturate_and_7_bit_rows_are_exact():
    """ONEDNN_MAX_CPU_ISA=AVX2 (a CPU without VNNI): the probe finds full-range row codes inexact,
    picks 63, and the certified search still equals brute force."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "63", "True"]
