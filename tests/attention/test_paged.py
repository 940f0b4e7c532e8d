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


def test_gather_spans_reads_exactly_the_spans_and_zero_pads():
    keys, values, table, rows = _cache([11, 6])
    spans = gather_spans(keys, values, table, torch.tensor([3, 2]), torch.tensor([11, 6]))
    assert torch.equal(spans.k[0], rows[0][0][3:])
    assert torch.equal(spans.k[1, :4], rows[1][0][2:]) and not spans.k[1, 4:].any()
    assert spans.valid.tolist() == [[True] * 8, [True] * 4 + [False] * 4]
    assert not torch.isnan(spans.v).any()  # NaN rows outside the spans were never read


@pytest.mark.parametrize("chunk_elements", [1 << 24, 1])  # one chunk, one token per chunk
def test_causal_part_equals_dense_attention_per_request(monkeypatch, chunk_elements):
    monkeypatch.setattr(paged, "CHUNK_ELEMENTS", chunk_elements)
    keys, values, table, rows = _cache([9, 7], seed=1)
    g = torch.Generator().manual_seed(2)
    q, q_pos, q_span = torch.randn(4, H_Q, D, generator=g), torch.tensor([4, 8, 5, 6]), torch.tensor([0, 0, 1, 1])
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
