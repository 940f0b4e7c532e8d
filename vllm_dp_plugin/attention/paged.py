"""Exact attention over a span of a paged KV cache, returned as a mergeable part.

Serving answers a public token's attention as (DP part over the private rows) merged with
(exact part over the public rows). This module is the exact half: it gathers only the rows of
the span it is given, so the private rows of the cache are never read for a public query.

Cache layout (vLLM's head-major ``LBHNC``): ``key_cache, value_cache: [num_blocks, H_kv,
block_size, d]``; a request's row at position ``p`` lives in block ``block_table[p // bs]`` at
offset ``p % bs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .merge import AttentionPart


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


def gather_span(cache: torch.Tensor, blocks: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows ``[start, end)`` of one request: ``cache: [nb, H, bs, d]``, ``blocks: [max_blocks]``
    -> ``[end - start, H, d]``. Reads nothing outside the span."""
    block_size = cache.shape[2]
    pos = torch.arange(start, end, device=blocks.device)
    return cache[blocks[pos // block_size].to(cache.device), :, (pos % block_size).to(cache.device)]


def causal_part(
    q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_start: int, scale: float
) -> AttentionPart:
    """Softmax attention of ``q: [m, H_q, d]`` (positions ``q_pos: [m]``) over the keys
    ``k: [L, H_kv, d]``, ``v: [L, H_kv, d_v]`` at positions ``k_start + [0, L)``, each query
    seeing keys at positions <= its own (GQA: query head h reads KV head h // (H_q / H_kv)).
    Float32 math; ``out: [H_q, m, d_v]``, ``lse: [H_q, m]``. Every query must see >= 1 key."""
    groups = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(groups, dim=1)  # [L, H_q, d]
    vf = v.float().repeat_interleave(groups, dim=1)
    logits = scale * torch.einsum("mhd,lhd->hml", q.float(), kf)
    k_pos = k_start + torch.arange(k.shape[0], device=q_pos.device)
    visible = (k_pos[None, :] <= q_pos[:, None]).to(logits.device)  # [m, L]
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.einsum("hml,lhd->hmd", torch.softmax(logits, dim=-1), vf)
    return AttentionPart(out, lse)
