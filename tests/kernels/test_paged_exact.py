"""The fused CPU exact-attention kernel equals its torch reference (gather_spans + causal_part)
on shuffled paged caches, never reads a row outside a query's span, and handles the CPU cache's
dimension-major K view, GQA and bf16 caches."""

import pytest
import torch

from vllm_dp_plugin.attention.paged import causal_part, gather_spans
from vllm_dp_plugin.kernels.paged_exact import fused_available, paged_exact

from ..attention.test_paged import BS, H_Q, D, _cache

pytestmark = pytest.mark.skipif(not fused_available(), reason="no C++ toolchain for the CPU kernel")

LENGTHS, START = [11, 9, 6], torch.tensor([3, 5, 0])  # span r: rows [START_r, LENGTHS_r)


def _queries(seed: int, q_span: list[int]):
    g = torch.Generator().manual_seed(seed)
    span = torch.tensor(q_span)
    end = torch.tensor(LENGTHS)[span]
    pos = START[span] + (torch.rand(len(q_span), generator=g) * (end - START[span])).long()  # visible
    return torch.randn(len(q_span), H_Q, D, generator=g), pos, span


def _both(keys, values, table, q, pos, span):
    end = torch.tensor(LENGTHS)
    reference = causal_part(q, pos, span, gather_spans(keys, values, table, START, end), 0.6)
    return paged_exact(q, pos, span, keys, values, table, START, end, 0.6), reference


@pytest.mark.parametrize("q_span", [[0, 1, 2], [2, 0, 0, 1, 2, 2], [1]])  # one each, ragged/unsorted, one span
def test_fused_equals_reference(q_span):
    keys, values, table, _ = _cache(LENGTHS, seed=7)  # NaN in every unused row
    fused, reference = _both(keys, values, table, *_queries(8, q_span))
    torch.testing.assert_close(fused.out, reference.out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.lse, reference.lse, rtol=1e-5, atol=1e-6)


def test_rows_outside_the_spans_are_never_read():
    """NaN in every row before START (the private prefix) and at or past each query's position
    + 1 would poison the output if the kernel addressed them."""
    keys, values, table, _ = _cache(LENGTHS, seed=9)
    q, pos, span = _queries(10, [0, 1, 2, 0])  # every span has a query
    clean = _both(keys, values, table, q, pos, span)[0]
    for r, (first, n) in enumerate(zip(START.tolist(), LENGTHS)):
        last = int(pos[span == r].max())
        hidden = torch.tensor([p for p in range(n) if p < first or p > last], dtype=torch.long)
        keys[table[r, hidden // BS], :, hidden % BS] = float("nan")
        values[table[r, hidden // BS], :, hidden % BS] = float("nan")
    poisoned = _both(keys, values, table, q, pos, span)[0]
    assert torch.equal(poisoned.out, clean.out) and torch.equal(poisoned.lse, clean.lse)


def test_dimension_major_key_view_and_bf16_cache():
    """The CPU K cache may hold each block as ``[d, bs]``: a strided ``[nb, H, bs, d]`` view."""
    keys, values, table, _ = _cache(LENGTHS, seed=11)
    dim_major = keys.transpose(2, 3).contiguous().transpose(2, 3)  # same values, K strides swapped
    q, pos, span = _queries(12, [0, 2, 1])
    fused, reference = _both(dim_major, values, table, q, pos, span)
    torch.testing.assert_close(fused.out, reference.out, rtol=1e-5, atol=1e-6)
    fused, reference = _both(keys.bfloat16(), values.bfloat16(), table, q, pos, span)
    torch.testing.assert_close(fused.out, reference.out, rtol=1e-5, atol=1e-6)


def test_a_query_that_sees_no_row_is_refused():
    keys, values, table, _ = _cache(LENGTHS, seed=13)
    q, _, span = _queries(14, [0])
    with pytest.raises(ValueError, match="start <= q_pos < end"):
        paged_exact(q, torch.tensor([2]), span, keys, values, table, START, torch.tensor(LENGTHS), 0.6)
