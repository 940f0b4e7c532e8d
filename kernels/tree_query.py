"""DPTree query: gather-contract over the path-sum table (one gather per query feature).

For one KV head, ``table [F, N, C*3*W]`` (the path-sum table ``PS[f, leaf, c, q, w]``, float32
or float64, trailing dim ordered (c, q, w)), ``bins [m, F]`` (the leaf of each query feature) and
``values [m, F]`` float64 (the query features v):

    out[i, c, w] = sum_f  v_if^2 PS[f, b_if, c, 0, w] - 2 v_if PS[f, b_if, c, 1, w]
                          + PS[f, b_if, c, 2, w]

i.e. ``sum_f DistanceQuery_f(v_if)`` of every copy and weight column, returned as ``[m, C, W]``
float64 (``copies`` C is an argument: it splits the trailing dim). An optional leading batch dim
(heads) is supported: ``table [B, F, N, K]``, ``bins``/``values [B, m, F]`` -> ``[B, m, C, W]`` (gathered entries are promoted to float64 before the contraction: there is large
cancellation downstream between ``P_wx`` and this sum). Implementations share one signature:
``gather_contract_torch`` (gather + einsum, chunked over m), ``gather_contract_triton`` (one
program per (query, block of (c, w)) reducing over blocks of features) and the dispatcher
``gather_contract`` (same rule as ``tree_build.backend_for``).
"""

from __future__ import annotations

import functools

import torch

from .tree_build import MOMENTS, backend_for, interpret_requested

GATHER_BYTES = 1 << 27  # torch path: cap on one chunk's gathered [m_chunk, F, C*3*W] float64


def _batched(table: torch.Tensor, bins: torch.Tensor, values: torch.Tensor, copies: int):
    """Validate; return ``table [B, F, N, K]``, int64 ``bins`` and float64 ``values [B, m, F]``,
    W and whether the caller passed the unbatched form."""
    single = table.dim() == 3
    if (
        table.dim() not in (3, 4)
        or bins.dim() != table.dim() - 1
        or values.shape != bins.shape
        or (not single and bins.shape[0] != table.shape[0])
    ):
        raise ValueError(
            f"need table [(B,) F, N, C*3*W], bins [(B,) m, F] and values [(B,) m, F], got "
            f"{tuple(table.shape)}, {tuple(bins.shape)}, {tuple(values.shape)}"
        )
    if bins.shape[-1] != table.shape[-3]:
        raise ValueError(f"bins have F={bins.shape[-1]} features, table has {table.shape[-3]}")
    if copies < 1 or table.shape[-1] % (MOMENTS * copies):
        raise ValueError(f"table trailing dim {table.shape[-1]} is not C*3*W with C={copies}")
    values = values.to(device=table.device, dtype=torch.float64)
    bins = bins.to(device=table.device, dtype=torch.int64)
    if single:
        table, bins, values = table[None], bins[None], values[None]
    return table, bins, values, table.shape[-1] // (MOMENTS * copies), single


def gather_contract_torch(
    table: torch.Tensor, bins: torch.Tensor, values: torch.Tensor, copies: int
) -> torch.Tensor:
    """Reference: ``[(B,) m, C, W]`` float64 (see module doc)."""
    table, bins, values, W, single = _batched(table, bins, values, copies)
    B, F, N, K = table.shape
    m = bins.shape[1]
    flat = table.reshape(B * F * N, K)
    trees = torch.arange(B, device=table.device)[:, None, None] * F + torch.arange(F, device=table.device)
    rows = (bins + trees * N).reshape(B * m, F)  # [B*m, F] rows of flat
    values = values.reshape(B * m, F)
    out = torch.empty(B * m, copies, W, dtype=torch.float64, device=table.device)
    chunk = max(1, GATHER_BYTES // max(1, 8 * F * K))
    for i0 in range(0, B * m, chunk):
        i1 = min(B * m, i0 + chunk)
        v = values[i0:i1]
        gathered = torch.index_select(flat, 0, rows[i0:i1].reshape(-1)).to(torch.float64)
        gathered = gathered.view(i1 - i0, F, copies, MOMENTS, W)
        coef = torch.stack((v * v, -2.0 * v, torch.ones_like(v)), dim=-1)  # [mc, F, 3]
        out[i0:i1] = torch.einsum("mfq,mfcqw->mcw", coef, gathered)
    out = out.view(B, m, copies, W)
    return out[0] if single else out


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """Decorate the kernel now (``interpret`` only keys the cache: triton reads the env var)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather_contract_kernel(
        table_ptr, bins_ptr, v_ptr, out_ptr,
        m, F, N, K, CW, W,
        stride_bb, stride_bm, stride_bf, stride_vb, stride_vm, stride_vf,
        BLOCK_F: tl.constexpr, BLOCK_CW: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # (batch, query), flattened
        b = row // m
        i = row % m
        cw = tl.program_id(1) * BLOCK_CW + tl.arange(0, BLOCK_CW)
        cw_mask = cw < CW
        col = (cw // W) * (3 * W) + cw % W  # offset of (c, q=0, w) inside one table row
        acc = tl.zeros([BLOCK_CW], dtype=tl.float64)
        for f0 in range(0, F, BLOCK_F):
            fs = f0 + tl.arange(0, BLOCK_F)
            f_mask = fs < F
            bq = tl.load(bins_ptr + b * stride_bb + i * stride_bm + fs * stride_bf, mask=f_mask, other=0)
            v = tl.load(v_ptr + b * stride_vb + i * stride_vm + fs * stride_vf, mask=f_mask, other=0.0)
            base = ((b * F + fs.to(tl.int64)) * N + bq.to(tl.int64)) * K
            ptr = table_ptr + base[:, None] + col[None, :]
            mask = f_mask[:, None] & cw_mask[None, :]
            t0 = tl.load(ptr, mask=mask, other=0.0).to(tl.float64)
            t1 = tl.load(ptr + W, mask=mask, other=0.0).to(tl.float64)
            t2 = tl.load(ptr + 2 * W, mask=mask, other=0.0).to(tl.float64)
            term = (v * v)[:, None] * t0 + (-2.0 * v)[:, None] * t1 + t2
            acc += tl.sum(term, axis=0)
        tl.store(out_ptr + row * CW + cw, acc, mask=cw_mask)

    return gather_contract_kernel


def gather_contract_triton(
    table: torch.Tensor, bins: torch.Tensor, values: torch.Tensor, copies: int
) -> torch.Tensor:
    """Triton version of ``gather_contract_torch``."""
    import triton

    table, bins, values, W, single = _batched(table, bins, values, copies)
    table = table.contiguous()
    B, F, N, K = table.shape
    m = bins.shape[1]
    out = torch.zeros(B, m, copies, W, dtype=torch.float64, device=table.device)
    if B and m and W:
        block_cw = min(128, triton.next_power_of_2(copies * W))
        grid = (B * m, triton.cdiv(copies * W, block_cw))
        _kernel(interpret_requested())[grid](
            table, bins, values, out,
            m, F, N, K, copies * W, W,
            bins.stride(0), bins.stride(1), bins.stride(2),
            values.stride(0), values.stride(1), values.stride(2),
            BLOCK_F=32, BLOCK_CW=block_cw,
        )
    return out[0] if single else out


def gather_contract(
    table: torch.Tensor, bins: torch.Tensor, values: torch.Tensor, copies: int
) -> torch.Tensor:
    """Dispatcher: Triton where ``backend_for(table) == "triton"``, else torch."""
    if backend_for(table) == "triton":
        return gather_contract_triton(table, bins, values, copies)
    return gather_contract_torch(table, bins, values, copies)
