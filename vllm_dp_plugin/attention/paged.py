"""Exact attention over spans of a paged KV cache, returned as a mergeable part.

Serving answers a public token's attention as (DP part over the private rows) merged with
(exact part over the public rows). This module is the exact half: it copies the blocks holding
the spans it is given and zeroes every row outside them, so the private rows of the cache never
enter a public query's arithmetic. Batched over requests (one block gather per cache, chunked
matmuls), so a decode step costs a few tensor ops.

Cache layout (vLLM's head-major ``LBHNC``): ``key_cache, value_cache: [num_blocks, H_kv,
block_size, d]``; a request's row at position ``p`` lives in block ``block_table[p // bs]`` at
offset ``p % bs``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

import torch

from .merge import AttentionPart

T = TypeVar("T")
CHUNK_ELEMENTS = 1 << 24  # cap on one chunk's [c, H_q, L, d]-sized intermediates (64 MiB in fp32)


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

    def per_step(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()``, computed once per ``key`` on this layout: vLLM builds one layout per step
        and every layer reads it, so what depends on the step alone is not recomputed per layer."""
        cache = self.__dict__.setdefault("_per_step", {})  # frozen: no setattr
        if key not in cache:
            cache[key] = build()
        return cache[key]

    def request_of_tokens(self) -> torch.Tensor:
        """``[T]``: the request index of every query token (once per step)."""
        return self.per_step("request_of_tokens", self._request_of_tokens)

    def _request_of_tokens(self) -> torch.Tensor:
        counts = (self.query_start[1:] - self.query_start[:-1]).long()
        return torch.repeat_interleave(torch.arange(self.num_requests), counts)

    def public_queries(self, first_row: int | torch.Tensor) -> PublicQueries:
        """The step's tokens at positions >= their request's ``first_row`` (one for every request,
        or ``[B]``, one per request) and the rows their exact part reads; computed once per step
        and shared by every layer."""
        key = first_row if isinstance(first_row, int) else tuple(first_row.tolist())
        return self.per_step(("public_queries", key), lambda: _public_queries(self, first_row))


@dataclass(frozen=True)
class PublicQueries:
    """Query tokens at positions >= their request's first public row of a step: ``tokens``
    selects them among the step's tokens (``slice(None)`` when every token is public, else a
    ``[T]`` mask); ``positions, span: [m]`` (span: index into the R requests holding them, in
    order); ``requests: [R]`` those requests' batch indices; ``start, end: [R]`` = the first
    public row and the request's ``seq_len`` (the rows the exact part reads);
    ``block_table: [R, max_blocks]``."""

    tokens: slice | torch.Tensor
    positions: torch.Tensor
    span: torch.Tensor
    requests: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    block_table: torch.Tensor

    @property
    def count(self) -> int:
        return self.positions.shape[0]

    @property
    def everything(self) -> bool:
        """Every token of the step is public (decode steps)."""
        return isinstance(self.tokens, slice)


def _public_queries(layout: BatchLayout, first_row: int | torch.Tensor) -> PublicQueries:
    per_token = first_row if isinstance(first_row, int) else first_row[layout.request_of_tokens()]
    public = layout.positions >= per_token
    tokens = slice(None) if bool(public.all()) else public
    request = layout.request_of_tokens()[tokens]  # grouped by request, in order
    requests = torch.unique_consecutive(request)
    if requests.shape[0] == layout.num_requests:  # then requests == arange(B)
        table = layout.block_table[: layout.num_requests]
    else:
        table = layout.block_table[requests.to(layout.block_table.device)]
    start = torch.full_like(requests, first_row) if isinstance(first_row, int) else first_row[requests].long()
    return PublicQueries(
        tokens, layout.positions[tokens], torch.searchsorted(requests, request), requests,
        start, layout.seq_lens[requests].long(), table,
    )


@dataclass(frozen=True)
class Spans:
    """Rows of requests ``r`` gathered block by block: ``k, v: [R, H_kv, L, d]`` where row ``i``
    of request ``r`` is position ``start_r + i`` (``start`` is block-aligned); ``valid: [R, L]``
    marks the requested span, and every row outside it is zero."""

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
    """Rows ``[start_r, end_r)`` of each request (``block_table: [R, max_blocks]``, ``start``,
    ``end``: [R] positions). Copies the (block, head) slabs holding the spans, one
    ``index_select`` per cache, straight into ``[R, H, L, d]`` order, then overwrites every row
    outside ``[start_r, end_r)`` with zeros, so rows outside a span (e.g. private rows sharing
    the span's first block, stale rows past its end) never reach any arithmetic."""
    block_size, heads = key_cache.shape[2], key_cache.shape[1]
    requests = start.shape[0]
    first, last = start // block_size, (end - 1) // block_size  # [R] block columns
    num_blocks = int((last - first).max()) + 1 if requests else 0
    column = torch.minimum(first[:, None] + torch.arange(num_blocks), last[:, None])  # [R, nb]
    table = block_table.to(key_cache.device)
    blocks = torch.gather(table, 1, column.to(table.device)).long().cpu()  # [R, nb]
    slabs = (blocks[:, None, :] * heads + torch.arange(heads)[None, :, None]).flatten()  # [R H nb]
    slabs = slabs.to(key_cache.device)
    row_pos = first[:, None] * block_size + torch.arange(num_blocks * block_size)  # [R, L]
    valid = (row_pos >= start[:, None]) & (row_pos < end[:, None])
    outside = (~valid)[:, None, :].expand(requests, heads, -1).flatten().nonzero().squeeze(1)
    outside = outside.to(key_cache.device)  # flat row indices of [R, H, L]

    def rows(cache: torch.Tensor) -> torch.Tensor:  # [R, H, L, d], zero outside the spans
        dim = cache.shape[3]
        slab_view = cache.view(-1, block_size, dim)  # [num_blocks H, bs, d]; a view, never a copy
        picked = slab_view.index_select(0, slabs)  # [R H nb, bs, d]
        picked.view(-1, dim).index_fill_(0, outside, 0.0)  # a fresh copy: the cache is untouched
        return picked.view(requests, heads, num_blocks * block_size, dim)

    return Spans(rows(key_cache), rows(value_cache), valid, first * block_size)


def causal_part(
    q: torch.Tensor, q_pos: torch.Tensor, q_span: torch.Tensor, spans: Spans, scale: float
) -> AttentionPart:
    """Softmax attention of ``q: [m, H_q, d]`` (positions ``q_pos: [m]``) over its span
    ``spans[q_span]``, each query seeing the span's rows at positions <= its own (GQA: query
    head h reads KV head h // (H_q / H_kv)). Float32; ``out: [H_q, m, d_v]``, ``lse: [H_q, m]``.
    Every query must see >= 1 row.

    Queries are grouped per span (``[R, M, H_q, d]``, M = most queries of one span, zero-padded)
    so each span's keys are multiplied in place, never copied per query; chunked over M."""
    m, heads, d = q.shape
    spans_n, kv_heads, length, _ = spans.k.shape
    groups = heads // kv_heads
    counts = torch.bincount(q_span, minlength=spans_n)
    most = int(counts.max())
    if bool((counts == most).all()) and bool((q_span[1:] >= q_span[:-1]).all()):
        slot = None  # every span has `most` queries, in order (decode: one each): a plain view
        padded, pos = q.float().view(spans_n, most, heads, d), q_pos.long().view(spans_n, most)
    else:
        slot = _slots(q_span, counts)  # [m]: the query's index within its span
        padded = q.new_zeros(spans_n, most, heads, d, dtype=torch.float32)
        padded[q_span, slot] = q.float()
        pos = torch.full((spans_n, most), -1, dtype=torch.long)  # padding sees nothing
        pos[q_span, slot] = q_pos.long()
    k_pos = spans.start[:, None] + torch.arange(length)  # [R, L]
    k_t, v = spans.k.float().transpose(-1, -2), spans.v.float()  # [R, H_kv, d, L], [R, H_kv, L, d]
    chunk = max(1, CHUNK_ELEMENTS // max(1, spans_n * heads * length))
    outs, lses = [], []
    for lo in range(0, most, chunk):
        qc = padded[:, lo : lo + chunk]  # [R, c, H_q, d]
        c = qc.shape[1]
        qc = qc.view(spans_n, c, kv_heads, groups, d).permute(0, 2, 1, 3, 4).reshape(spans_n, kv_heads, c * groups, d)
        logits = (scale * (qc @ k_t)).view(spans_n, kv_heads, c, groups, length)  # [R, H_kv, c, G, L]
        visible = spans.valid[:, None, :] & (k_pos[:, None, :] <= pos[:, lo : lo + chunk, None])  # [R, c, L]
        logits += torch.where(visible, 0.0, float("-inf")).to(logits.device)[:, None, :, None, :]
        top = logits.amax(dim=-1, keepdim=True)  # -inf only for padding queries (dropped below)
        weights = logits.sub_(top).exp_()  # in place: unnormalised softmax
        total = weights.sum(dim=-1)  # [R, H_kv, c, G]
        out = (weights.view(spans_n, kv_heads, c * groups, length) @ v).view(spans_n, kv_heads, c, groups, d)
        out /= total[..., None]
        lse = top.squeeze(-1) + total.log()  # [R, H_kv, c, G]
        outs.append(out.permute(0, 2, 1, 3, 4).reshape(spans_n, c, heads, d))
        lses.append(lse.permute(0, 2, 1, 3).reshape(spans_n, c, heads))
    out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=1)  # [R, M, H_q, *]
    if slot is None:
        out, lse = out.view(m, heads, d), lse.view(m, heads)
    else:
        out, lse = out[q_span, slot], lse[q_span, slot]
    return AttentionPart(out.transpose(0, 1), lse.transpose(0, 1))


def _slots(q_span: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[m]``: for each query, how many earlier queries (in batch order) share its span
    (``counts: [R]`` queries per span)."""
    order = torch.argsort(q_span, stable=True)
    first = torch.cumsum(counts, 0) - counts  # [R] offset of each span's queries in `order`
    slot = torch.empty_like(q_span)
    slot[order] = torch.arange(q_span.shape[0]) - first[q_span[order]]
    return slot
