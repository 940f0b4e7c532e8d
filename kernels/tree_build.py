"""DPTree build: binning + exact leaf moment histograms (the exact data of every tree's leaves).

For one KV head, ``pk [n, F]`` (the feature value u of row j in tree f), ``weights [n, W]``
(the weight column w, last one the all-ones denominator column), ``lo, hi [F]`` and ``leaves`` N:

    bin(u)                = clamp(floor((u - lo) * N / (hi - lo)), 0, N - 1)      (0-based)
    out[f, bin(u_jf), q, w] += weights[j, w] * u_jf^q,    q = 0, 1, 2 (exact u^q: 1, u, u*u)

returned as ``[F, N, 3, W]`` float64. An optional leading batch dim (heads) is supported:
``pk [B, n, F]``, ``weights [B, n, W]`` -> ``[B, F, N, 3, W]`` (lo/hi shared). Three
implementations with one signature:

* ``leaf_histogram_torch``: ``index_add_`` in float64, chunked over (B, F) so that the payload
  ``[B_chunk, n, F_chunk, 3, W]`` stays under ``PAYLOAD_BYTES``.
* ``leaf_histogram_triton``: one program per (feature, block of rows) x batch; float64 ``atomic_add``
  (so the summation order, hence the last bits, differ from the torch reference).
* ``leaf_histogram``: the dispatcher: Triton on CUDA tensors or under ``TRITON_INTERPRET=1``
  when triton imports, torch otherwise (``backend_for`` tells which).

Triton is imported lazily and the kernels are decorated at first launch, so this module imports
without triton and honours a ``TRITON_INTERPRET`` set after import (triton reads it when
``triton.jit`` decorates).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

PAYLOAD_BYTES = 1 << 27  # torch path: cap on one chunk's [n, F_chunk, 3, W] float64 payload
MOMENTS = 3


def interpret_requested() -> bool:
    """True when ``TRITON_INTERPRET`` asks for triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend_for(tensor: torch.Tensor) -> str:
    """``"triton"`` for CUDA tensors (or any tensor under ``TRITON_INTERPRET=1``) when triton is
    installed, ``"torch"`` otherwise."""
    if triton_available() and (tensor.is_cuda or interpret_requested()):
        return "triton"
    return "torch"


def bin_index(values: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, leaves: int) -> torch.Tensor:
    """0-based leaf of every value: ``clamp(floor((u - lo) * N / (hi - lo)), 0, N - 1)``, int64.

    ``values [..., F]`` float64, ``lo, hi [F]``; the operation order is the one every
    implementation (and the Triton kernel) uses, so bin edges land identically."""
    scaled = torch.floor((values - lo) * leaves / (hi - lo))
    return scaled.clamp_(0.0, leaves - 1.0).to(torch.int64)


def plan_chunks(batch: int, features: int, unit_bytes: int, budget: int):
    """Rectangles ``(b0, b1, f0, f1)`` covering ``[batch, features]`` in (b, f) order, each of at
    most ``max(budget, unit_bytes)`` bytes at ``unit_bytes`` per (b, f) item: whole feature rows
    of several batch entries when one row fits, else feature chunks of one entry."""
    unit_bytes = max(1, unit_bytes)
    if features * unit_bytes <= budget:
        step = max(1, budget // (features * unit_bytes))
        for b0 in range(0, batch, step):
            yield b0, min(batch, b0 + step), 0, features
        return
    step = max(1, budget // unit_bytes)
    for b in range(batch):
        for f0 in range(0, features, step):
            yield b, b + 1, f0, min(features, f0 + step)


def _batched(pk: torch.Tensor, weights: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, leaves: int):
    """Validate; return float64 ``pk [B, n, F]``, ``weights [B, n, W]``, lo, hi and whether the
    caller passed the unbatched form."""
    single = pk.dim() == 2
    if pk.dim() not in (2, 3) or weights.dim() != pk.dim() or pk.shape[:-1] != weights.shape[:-1]:
        raise ValueError(
            f"need pk [(B,) n, F] and weights [(B,) n, W], got {tuple(pk.shape)} and {tuple(weights.shape)}"
        )
    F = pk.shape[-1]
    if lo.shape != (F,) or hi.shape != (F,):
        raise ValueError(f"lo/hi must be [F={F}], got {tuple(lo.shape)}, {tuple(hi.shape)}")
    if leaves < 1:
        raise ValueError(f"leaves must be >= 1, got {leaves}")
    pk, weights = pk.to(torch.float64), weights.to(device=pk.device, dtype=torch.float64)
    if single:
        pk, weights = pk[None], weights[None]
    lo = lo.to(device=pk.device, dtype=torch.float64).contiguous()
    hi = hi.to(device=pk.device, dtype=torch.float64).contiguous()
    return pk, weights, lo, hi, single


def leaf_histogram_torch(
    pk: torch.Tensor, weights: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, leaves: int
) -> torch.Tensor:
    """Reference: ``[(B,) F, N, 3, W]`` float64 leaf moments by ``index_add_`` (module doc)."""
    pk, weights, lo, hi, single = _batched(pk, weights, lo, hi, leaves)
    B, n, F = pk.shape
    W = weights.shape[2]
    out = torch.zeros(B * F * leaves, MOMENTS, W, dtype=torch.float64, device=pk.device)
    for b0, b1, f0, f1 in plan_chunks(B, F, 8 * n * MOMENTS * W, PAYLOAD_BYTES):
        u = pk[b0:b1, :, f0:f1]  # [Bc, n, Fc]
        trees = torch.arange(b0, b1, device=pk.device)[:, None] * F + torch.arange(f0, f1, device=pk.device)
        rows = bin_index(u, lo[f0:f1], hi[f0:f1], leaves) + trees[:, None, :] * leaves
        powers = torch.stack((torch.ones_like(u), u, u * u), dim=-1)  # [Bc, n, Fc, 3]
        payload = powers[..., None] * weights[b0:b1, :, None, None, :]  # [Bc, n, Fc, 3, W]
        out.index_add_(0, rows.reshape(-1), payload.reshape(-1, MOMENTS, W))
    out = out.view(B, F, leaves, MOMENTS, W)
    return out[0] if single else out


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """Decorate the kernel now (``interpret`` only keys the cache: triton reads the env var)."""
    import triton
    import triton.language as tl

    @triton.jit
    def leaf_histogram_kernel(
        pk_ptr, w_ptr, lo_ptr, hi_ptr, out_ptr,
        n, F, W, N,
        stride_pb, stride_pn, stride_pf, stride_wb, stride_wn, stride_ww,
        BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        row_blocks = tl.cdiv(n, BLOCK_N)
        pid = tl.program_id(0).to(tl.int64)  # (feature, block of rows), flattened: no 65535 cap
        f = pid // row_blocks
        b = tl.program_id(1).to(tl.int64)
        rows = (pid % row_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < n
        u = tl.load(pk_ptr + b * stride_pb + rows * stride_pn + f * stride_pf, mask=rmask, other=0.0)
        lo = tl.load(lo_ptr + f)
        hi = tl.load(hi_ptr + f)
        scaled = tl.floor((u - lo) * N / (hi - lo))
        scaled = tl.minimum(tl.maximum(scaled, 0.0), N - 1.0)
        base = ((b * F + f) * N + scaled.to(tl.int64)) * (3 * W)  # offset of (b, f, bin, 0, 0)
        u2 = u * u
        w_rows = w_ptr + b * stride_wb + rows * stride_wn
        for w0 in range(0, W, BLOCK_W):
            cols = w0 + tl.arange(0, BLOCK_W)
            mask = rmask[:, None] & (cols < W)[None, :]
            wt = tl.load(w_rows[:, None] + cols[None, :] * stride_ww, mask=mask, other=0.0)
            ptr = out_ptr + base[:, None] + cols[None, :]
            tl.atomic_add(ptr, wt, mask=mask)
            tl.atomic_add(ptr + W, wt * u[:, None], mask=mask)
            tl.atomic_add(ptr + 2 * W, wt * u2[:, None], mask=mask)

    return leaf_histogram_kernel


def leaf_histogram_triton(
    pk: torch.Tensor, weights: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, leaves: int
) -> torch.Tensor:
    """Triton version of ``leaf_histogram_torch`` (float64 atomics)."""
    import triton

    pk, weights, lo, hi, single = _batched(pk, weights, lo, hi, leaves)
    B, n, F = pk.shape
    W = weights.shape[2]
    out = torch.zeros(B, F, leaves, MOMENTS, W, dtype=torch.float64, device=pk.device)
    if B and n and F and W:
        block_n = 64
        block_w = min(64, triton.next_power_of_2(W))
        grid = (triton.cdiv(n, block_n) * F, B)
        _kernel(interpret_requested())[grid](
            pk, weights, lo, hi, out,
            n, F, W, leaves,
            pk.stride(0), pk.stride(1), pk.stride(2),
            weights.stride(0), weights.stride(1), weights.stride(2),
            BLOCK_N=block_n, BLOCK_W=block_w,
        )
    return out[0] if single else out


def leaf_histogram(
    pk: torch.Tensor, weights: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, leaves: int
) -> torch.Tensor:
    """Dispatcher: ``leaf_histogram_triton`` where ``backend_for(pk) == "triton"``, else torch."""
    if backend_for(pk) == "triton":
        return leaf_histogram_triton(pk, weights, lo, hi, leaves)
    return leaf_histogram_torch(pk, weights, lo, hi, leaves)
