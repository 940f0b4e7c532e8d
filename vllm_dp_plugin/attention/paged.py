"""Exact attention over spans of a paged KV cache, returned as a mergeable part.

Serving answers a public token's attention as (DP part over the private rows) merged with
(exact part over the public rows). This module is the exact half: it gathers only the rows of
the spans it is given, so the private rows of the cache are never read for a public query.
Batched over requests (one gather, chunked einsums), so a decode step costs a few tensor ops.

Cache layout (vLLM's head-major ``LBHNC``): ``key_cache, value_cache: [num_blocks, H_kv,
block_size, d]``; a request's row at position ``p`` lives in block ``block_table[p // bs]`` at
offset ``p % bs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .merge import AttentionPart

CHUNK_ELEMENTS = 1 << 24  # cap on one chunk's [m, L, H_q, d] key expansion (64 MiB in fp32)


@dataclass(frozen=True)
class BatchLayout:
    """Where each request's tokens are: all on CPU except ``block_table``.

    ``query_start: [B + 1]`` token offsets of each request's queries in the batch;
    ``seq_lens: [B]`` rows in the cache after this step (query rows included);
    ``positions: [T]`` absolute position of each query token; ``block_table: [B, max_blocks]``.
    """

    query_start: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    def tokens(self, r: int) -> slice:
        return slice(int(self.query_start[r]), int(self.query_start[r + 1]))

    def request_of_tokens(self) -> torch.Tensor:
        """``[T]``: the request index of every query token."""
        counts = (self.query_start[1:] - self.query_start[:-1]).long()
        return torch.repeat_interleave(torch.arange(self.num_requests), counts)


@dataclass(frozen=True)
class Spans:
    """Rows ``[start_r, end_r)`` of requests ``r``: ``k, v: [R, L, H_kv, d]`` (zero-padded),
    ``valid: [R, L]``, ``start: [R]``."""

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor
    start: torch.Tensor


def gather_spans(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
) -> Spans:
    """Rows ``[start_r, end_r)`` of each request (``block_table: [R, max_blocks]``). Padding
    re-reads row ``start_r`` (inside the span) and is zeroed: nothing outside a span is read."""
    block_size = key_cache.shape[2]
    length = int((end - start).max()) if start.numel() else 0
    offsets = torch.arange(length)
    pos = start[:, None] + offsets[None, :]  # [R, L]
    valid = pos < end[:, None]
    pos = torch.where(valid, pos, start[:, None])
    table = block_table.to(key_cache.device)
    blocks = torch.gather(table, 1, (pos // block_size).to(table.device)).to(key_cache.device)
    rows = (pos % block_size).to(key_cache.device)
    mask = valid.to(key_cache.device)[..., None, None]
    k = torch.where(mask, key_cache[blocks, :, rows], 0)  # [R, L, H, d]
    v = torch.where(mask, value_cache[blocks, :, rows], 0)
    return Spans(k, v, valid, start)


def causal_part(
    q: torch.Tensor, q_pos: torch.Tensor, q_span: torch.Tensor, spans: Spans, scale: float
) -> AttentionPart:
    """Softmax attention of ``q: [m, H_q, d]`` (positions ``q_pos: [m]``) over its span
    ``spans[q_span]``, each query seeing the span's rows at positions <= its own (GQA: query
    head h reads KV head h // (H_q / H_kv)). Float32; ``out: [H_q, m, d_v]``, ``lse: [H_q, m]``.
    Every query must see >= 1 row."""
    m, heads, d = q.shape
    groups = heads // spans.k.shape[2]
    length = spans.k.shape[1]
    chunk = max(1, CHUNK_ELEMENTS // max(1, length * heads * d))
    outs, lses = [], []
    for lo in range(0, m, chunk):
        sl = slice(lo, lo + chunk)
        span = q_span[sl]
        k = spans.k[span].float().repeat_interleave(groups, dim=2)  # [c, L, H_q, d]
        v = spans.v[span].float().repeat_interleave(groups, dim=2)
        logits = scale * torch.einsum("chd,clhd->hcl", q[sl].float(), k)
        k_pos = spans.start[span][:, None] + torch.arange(length)[None, :]  # [c, L]
        visible = spans.valid[span] & (k_pos <= q_pos[sl][:, None])
        logits = logits.masked_fill(~visible.to(logits.device), float("-inf"))
        lses.append(torch.logsumexp(logits, dim=-1))
        outs.append(torch.einsum("hcl,clhd->hcd", torch.softmax(logits, dim=-1), v))
    return AttentionPart(torch.cat(outs, dim=1), torch.cat(lses, dim=1))
