"""Exact attention over spans of a paged cache: gathers only the spans, equals dense causal
attention per request, and splitting the keys at the private boundary then merging is exact."""

import pytest
import torch

from vllm_dp_plugin.attention import paged
from vllm_dp_plugin.attention.merge import merge_parts
from vllm_dp_plugin.attention.paged import BatchLayout, causal_part, gather_spans

BS, H_KV, H_Q, D = 4, 2, 4, 8


def _cache(lengths, seed=0):
    """Two requests' rows scattered into one shuffled paged cache whose unused rows are NaN."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in lengths]
    perm = torch.randperm(sum(need) + 3, generator=g)
    keys = torch.full((sum(need) + 3, H_KV, BS, D), float("nan"))
    values = keys.clone()
    table = torch.zeros(len(lengths), max(need), dtype=torch.long)
    rows = []
    for r, n in enumerate(lengths):
        table[r, : need[r]] = perm[sum(need[:r]) : sum(need[: r + 1])]
        k, v = torch.randn(n, H_KV, D, generator=g) * 2, torch.randn(n, H_KV, D, generator=g)
        pos = torch.arange(n)
        keys[table[r, pos // BS], :, pos % BS] = k
        values[table[r, pos // BS], :, pos % BS] = v
        rows.append((k, v))
    return keys, values, table, rows


def _dense(q, q_pos, k, v, start, scale):
    logits = scale * torch.einsum("mhd,lhd->hml", q, k.repeat_interleave(H_Q // H_KV, 1))
    k_pos = start + torch.arange(k.shape[0])
    logits = logits.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hml,lhd->hmd", logits.softmax(-1), v.repeat_interleave(H_Q // H_KV, 1))


def test_gather_spans_returns_the_spans_by_position_and_zeroes_everything_else():
    keys, values, table, rows = _cache([11, 6])
    spans = gather_spans(keys, values, table, torch.tensor([3, 5]), torch.tensor([11, 6]))
    assert spans.start.tolist() == [0, 4]  # block-aligned: row i is position start + i
    assert spans.valid.tolist() == [[False] * 3 + [True] * 8 + [False], [False, True] + [False] * 10]
    for r, (first, last) in enumerate([(3, 11), (5, 6)]):
        k, v = spans.k[r].transpose(0, 1), spans.v[r].transpose(0, 1)  # [L, H, d]
        assert torch.equal(k[spans.valid[r]], rows[r][0][first:last])
        assert torch.equal(v[spans.valid[r]], rows[r][1][first:last])
        assert not k[~spans.valid[r]].any() and not v[~spans.valid[r]].any()


def test_rows_outside_the_spans_never_reach_the_output():
    """Poison every cache row outside the spans (private rows of a shared block, rows past the
    end, other blocks): the exact part must not change."""
    keys, values, table, _ = _cache([10], seed=5)
    q, q_pos, span = torch.randn(2, H_Q, D, generator=torch.Generator().manual_seed(6)), torch.tensor([8, 9]), torch.zeros(2, dtype=torch.long)
    clean = causal_part(q, q_pos, span, gather_spans(keys, values, table, torch.tensor([3]), torch.tensor([9])), 0.5)
    pos = torch.tensor([0, 1, 2, 9])  # private rows in the first block and the row past the end
    keys[table[0, pos // BS], :, pos % BS] = float("nan")
    values[table[0, pos // BS], :, pos % BS] = float("nan")
    poisoned = causal_part(q, q_pos, span, gather_spans(keys, values, table, torch.tensor([3]), torch.tensor([9])), 0.5)
    assert torch.equal(poisoned.out, clean.out) and torch.equal(poisoned.lse, clean.lse)


@pytest.mark.parametrize("chunk_elements", [1 << 24, 1])  # one chunk, one token per chunk
@pytest.mark.parametrize("q_span", [[0, 0, 1, 1], [0, 1, 1, 1], [1, 0, 0, 1]])  # even, ragged, unsorted
def test_causal_part_equals_dense_attention_per_request(monkeypatch, chunk_elements, q_span):
    monkeypatch.setattr(paged, "CHUNK_ELEMENTS", chunk_elements)
    keys, values, table, rows = _cache([9, 7], seed=1)
    g = torch.Generator().manual_seed(2)
    q, q_pos, q_span = torch.randn(4, H_Q, D, generator=g), torch.tensor([4, 6, 5, 6]), torch.tensor(q_span)
    spans = gather_spans(keys, values, table, torch.tensor([0, 0]), torch.tensor([9, 7]))
    part = causal_part(q, q_pos, q_span, spans, 0.7)
    for t in range(4):
        k, v = rows[int(q_span[t])]
        expected = _dense(q[t : t + 1], q_pos[t : t + 1], k, v, 0, 0.7)[:, 0]
        torch.testing.assert_close(part.out[:, t], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split", [3, 6])
def test_splitting_at_the_private_boundary_and_merging_is_exact(split):
    keys, values, table, _ = _cache([10], seed=3)
    q, q_pos = torch.randn(4, H_Q, D, generator=torch.Generator().manual_seed(4)), torch.tensor([6, 7, 8, 9])
    span = torch.zeros(4, dtype=torch.long)

    def part(first, last):
        spans = gather_spans(keys, values, table, torch.tensor([first]), torch.tensor([last]))
        return causal_part(q, q_pos, span, spans, 0.5)

    whole, merged = part(0, 10), merge_parts(part(0, split), part(split, 10))
    torch.testing.assert_close(merged.out, whole.out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged.lse, whole.lse, rtol=1e-5, atol=1e-6)


def test_request_of_tokens():
    layout = BatchLayout(torch.tensor([0, 3, 3, 5]), torch.tensor([9, 4, 7]), torch.arange(5), torch.zeros(3, 1))
    assert layout.request_of_tokens().tolist() == [0, 0, 0, 2, 2]


def test_public_queries_select_public_tokens_and_their_spans_once_per_step():
    """Request 0 prefills positions 2..5 across the boundary P = 4, request 1 is empty, request 2
    decodes position 9: the public tokens are 4, 5 (request 0) and 9 (request 2)."""
    table = torch.arange(9).view(3, 3)
    layout = BatchLayout(torch.tensor([0, 4, 4, 5]), torch.tensor([6, 3, 10]),
                         torch.tensor([2, 3, 4, 5, 9]), table)
    public = layout.public_queries(4)
    assert public.tokens.tolist() == [False, False, True, True, True] and not public.everything
    assert public.positions.tolist() == [4, 5, 9] and public.span.tolist() == [0, 0, 1]
    assert public.start.tolist() == [4, 4] and public.end.tolist() == [6, 10]
    assert public.block_table.tolist() == [[0, 1, 2], [6, 7, 8]]
    assert layout.public_queries(4) is public  # shared by every layer of the step
    decode = BatchLayout(torch.tensor([0, 1, 2]), torch.tensor([7, 9]), torch.tensor([6, 8]), table[:2])
    assert decode.public_queries(4).everything and decode.public_queries(4).span.tolist() == [0, 1]
