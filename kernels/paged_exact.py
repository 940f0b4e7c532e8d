"""Exact causal attention over spans of a paged KV cache, fused for CPU (C++ via
``torch.utils.cpp_extension``), beside its torch reference ``attention.paged.gather_spans`` +
``causal_part``.

``paged_exact(q, q_pos, q_span, key_cache, value_cache, block_table, start, end, scale)``:
``q: [m, H_q, d]``, ``q_pos, q_span: [m]`` (the query's position and its span index),
caches ``[num_blocks, H_kv, block_size, d]`` (any strides: the CPU K cache may be dimension-major),
``block_table: [R, max_blocks]``, ``start, end: [R]``. Query ``i`` attends to rows
``[start_r, min(end_r, q_pos_i + 1))`` of span ``r = q_span_i``; nothing outside that range is
ever read. Returns an ``AttentionPart`` (``out: [H_q, m, d]``, ``lse: [H_q, m]``, float32), the
reference's contract. One call per layer instead of a gather plus a dozen small tensor ops.

The extension is built by ``cpu_extension`` (about a minute on 2 cores, once);
``fused_available()`` says whether it loaded. Where it cannot (no compiler, a CUDA cache) callers
keep the torch reference.
"""

from __future__ import annotations

import torch

from .cpu_extension import load
from .types import AttentionPart


def _extension():
    return load("paged_exact.cpp")


def fused_available() -> bool:
    """True when the C++ kernel is built (building it now if needed)."""
    return _extension() is not None


def paged_exact(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    q_span: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    scale: float,
) -> AttentionPart:
    """The fused CPU kernel (see the module docstring); needs ``fused_available()``. Raises
    ValueError when a query would see no row (``q_pos < start`` or ``q_pos >= end`` of its span)."""
    q_pos, q_span = q_pos.long().contiguous(), q_span.long().contiguous()
    start, end = start.long().contiguous(), end.long().contiguous()
    if q_pos.numel() and bool(((q_pos < start[q_span]) | (q_pos >= end[q_span])).any()):
        raise ValueError("paged_exact: every query needs start <= q_pos < end of its span")
    out, lse = _extension().paged_exact(
        q.float().contiguous(), q_pos, q_span, key_cache, value_cache,
        block_table.to(torch.int32), start, end, float(scale),
    )
    return AttentionPart(out.transpose(0, 1), lse.transpose(0, 1))
