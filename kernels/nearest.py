"""Nearest-candidate fast pass: fused GEMM + running top-k over the public candidate table.

For queries ``q [n, d]`` (fp32: the noisy vectors r), candidate rows ``e [K, d]`` (fp32 or bf16:
``CandidateIndex.fast_rows``) and ``sq_norms [K]`` fp32 (``||e||^2`` of the fp32 rows), the score
of candidate w for query r is

    s_w = ||e_w||^2 - 2 <e_w, r>        (fp32; squared distance minus the constant ||r||^2)

and the fast pass returns the positions ``[n, k]`` int64 (0..K-1) of the k smallest scores of each
query. Implementations share the ``types.FastPass`` signature:

* ``fast_topk_reference``: torch (``nearest_reference.fast_topk_torch``: one [n, K] score matrix and
  ``topk``);
* ``fast_topk_triton``: one Triton program per (block of ``BLOCK_N`` queries, split of the
  candidate range: split-K over the vocabulary). It streams over candidate tiles of ``BLOCK_K``
  rows, computes the tile's scores with ``tl.dot`` (inputs in the rows' dtype, the fp32 queries
  rounded to it on the host as torch does; fp32 accumulate; fp32 inputs use IEEE fp32, never
  TF32; under the interpreter bf16 operands are widened to fp32 first, which is exact, because
  its bf16 ``tl.dot`` is wrong) and keeps a running top-k
  in registers, so the [n, K] score matrix never exists in global memory. Each (score, position)
  pair is packed into one int64 key, order-preserving bits of the fp32 score in the high word and
  the position in the low word: keys are distinct and their integer order is (score, position)
  order. Per tile, the keys below the current k-th key are inserted smallest first by repeated
  min-extraction (``tl.min``/``tl.max`` only: after the first tiles, most tiles insert nothing and
  cost one compare). Each program writes its k keys to an ``[n, splits, k]`` buffer and a torch
  ``topk`` over ``splits * k`` keys merges them;
* ``default_fast_pass(device)``: the Triton pass on CUDA (or anywhere under ``TRITON_INTERPRET=1``)
  when triton is installed, the torch one otherwise.

Guarantee of ``fast_topk_triton``: with its own fp32 scores (which can differ from torch's GEMM in
the last bits: different summation order; and for bf16 rows torch rounds the dot products to bf16,
the kernel does not), the returned positions are the k lexicographically smallest
(score, position) pairs, sorted by score then position. The exact nearest candidate is then
chosen by ``CandidateIndex``'s float64 re-rank, so only membership in the top-k matters.

Triton is imported lazily and the kernel is decorated at first launch (as in ``tree_build``), so
this module imports without triton; ``prompt/`` stays pure torch and only receives the function.
"""

from __future__ import annotations

import functools

import torch

from .nearest_reference import fast_topk_torch
from .tree_build import interpret_requested, triton_available
from .types import FastPass

BLOCK_N = 64  # queries per program
BLOCK_K = 128  # candidate rows per tile
# embedding dims per tl.dot step (lowered for small d) by the rows' dtype; with BLOCK_N, BLOCK_K and
# 4 warps the fastest of 24 tilings at 128000 x 4096, batch 4096, on an H200 (benchmarks/gpu/diagnose.py:
# bf16 43.7%, fp32 36.8% of torch's GEMM; the earlier 64 x 64 x 64 reached 33.2% and 25.5%)
BLOCK_D = {torch.bfloat16: 64, torch.float32: 32}
MAX_TOPK = 128  # largest k the kernel keeps in registers; larger k falls back to torch
TARGET_PROGRAMS = 1024  # on CUDA, split the candidates until about this many programs run
MIN_TILES_PER_SPLIT = 8  # on CUDA: amortise the first tiles' inserts (up to k passes each)
INTERPRET_SPLITS = 4  # under the interpreter: few splits (programs run one by one)
FAST_DTYPES = (torch.float32, torch.bfloat16)


def _check(queries: torch.Tensor, fast_rows: torch.Tensor, sq_norms: torch.Tensor, k: int) -> None:
    """ValueError unless ``queries [n, d]``, ``fast_rows [K, d]`` fp32|bf16, ``sq_norms [K]`` on one
    device and ``1 <= k <= K``."""
    if queries.dim() != 2 or fast_rows.dim() != 2 or queries.shape[1] != fast_rows.shape[1]:
        raise ValueError(
            f"need queries [n, d] and fast_rows [K, d], got {tuple(queries.shape)} and "
            f"{tuple(fast_rows.shape)}"
        )
    if sq_norms.shape != (fast_rows.shape[0],):
        raise ValueError(f"sq_norms must be [K={fast_rows.shape[0]}], got {tuple(sq_norms.shape)}")
    if fast_rows.dtype not in FAST_DTYPES:
        raise ValueError(f"fast_rows must be float32 or bfloat16, got {fast_rows.dtype}")
    if not (queries.device == fast_rows.device == sq_norms.device):
        raise ValueError("queries, fast_rows and sq_norms must be on one device")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= fast_rows.shape[0]:
        raise ValueError(f"k must be an int in [1, K={fast_rows.shape[0]}], got {k!r}")
    if fast_rows.shape[0] >= 1 << 31:
        raise ValueError(f"K={fast_rows.shape[0]} candidates: positions must fit in 31 bits")


def fast_topk_reference(
    queries: torch.Tensor, fast_rows: torch.Tensor, sq_norms: torch.Tensor, k: int
) -> torch.Tensor:
    """Torch reference ``FastPass``: positions ``[n, k]`` int64 of the k smallest scores
    ``sq_norms - 2 q e^T`` per query (``nearest_reference.fast_topk_torch``), same validation as
    ``fast_topk_triton``. Order among exactly tied scores is torch's (unspecified)."""
    _check(queries, fast_rows, sq_norms, k)
    return fast_topk_torch(queries.to(torch.float32), fast_rows, sq_norms, k)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """Decorate the kernel now (``interpret`` only keys the cache: triton reads the env var)."""
    import triton
    import triton.language as tl

    @triton.jit
    def nearest_topk_kernel(
        q_ptr, e_ptr, sq_ptr, out_ptr,
        n, K, d, k, tiles_per_split,
        stride_qn, stride_ek, stride_on, stride_os,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
        K_PAD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < n
        split = tl.program_id(1)
        SENTINEL: tl.constexpr = 0x7FFFFFFFFFFFFFFF  # int64 max: after every real key
        # running top-k keys: slots < k start as distinct keys above every real one (so the row max
        # is unique); padding slots >= k hold keys below every real one and are never replaced
        slots = tl.arange(0, K_PAD)
        init = tl.where(slots < k, SENTINEL - 1 - slots.to(tl.int64), -SENTINEL - 1)
        best = tl.zeros([BLOCK_N, K_PAD], dtype=tl.int64) + init[None, :]
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qn
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, tl.cdiv(K, BLOCK_K))
        for tile in range(tile_lo, tile_hi):
            cols = tile * BLOCK_K + tl.arange(0, BLOCK_K)
            col_mask = cols < K
            e_cols = e_ptr + cols.to(tl.int64)[None, :] * stride_ek
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for d0 in range(0, d, BLOCK_D):
                dims = d0 + tl.arange(0, BLOCK_D)
                dim_mask = dims < d
                q_mask = row_mask[:, None] & dim_mask[None, :]
                e_mask = dim_mask[:, None] & col_mask[None, :]
                q = tl.load(q_rows + dims[None, :], mask=q_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
                e = tl.load(e_cols + dims[:, None], mask=e_mask, other=0.0)  # [BLOCK_D, BLOCK_K]
                if UPCAST:  # interpreter: its bf16 tl.dot is wrong; bf16 products are exact in fp32
                    acc = tl.dot(q.to(tl.float32), e.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(q, e, acc, input_precision=PRECISION)  # [BLOCK_N, BLOCK_K]
            sq = tl.load(sq_ptr + cols, mask=col_mask, other=0.0)
            score = sq[None, :] - 2.0 * acc
            score = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0: equal scores, equal keys
            bits = score.to(tl.int32, bitcast=True)
            ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int order == float order
            key = (ordered.to(tl.int64) << 32) | cols.to(tl.int64)[None, :]
            key = tl.where(col_mask[None, :], key, SENTINEL)  # [BLOCK_N, BLOCK_K]
            # insert the tile's keys below the current k-th key, smallest first; once the smallest
            # left fails to beat the (falling) k-th key, no later one can: `fresh` passes suffice
            kth = tl.max(best, axis=1)  # [BLOCK_N], unique per row (keys are distinct)
            fresh = tl.minimum(tl.max(tl.sum((key < kth[:, None]).to(tl.int32), axis=1)), k)
            for _ in range(fresh):
                low = tl.min(key, axis=1)  # [BLOCK_N] smallest tile key left
                key = tl.where(key == low[:, None], SENTINEL, key)
                replace = (best == kth[:, None]) & (low < kth)[:, None]
                best = tl.where(replace, low[:, None], best)
                kth = tl.max(best, axis=1)
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_on + split * stride_os + slots[None, :]
        tl.store(out, best, mask=row_mask[:, None] & (slots < k)[None, :])

    return nearest_topk_kernel


def _plan(n: int, K: int, d: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(block_k, block_d, splits, tiles_per_split) for one launch over rows of ``dtype``."""
    import triton

    block_k = BLOCK_K
    block_d = max(16, min(BLOCK_D[dtype], triton.next_power_of_2(d)))
    tiles = triton.cdiv(K, block_k)
    if device.type == "cuda":
        query_blocks = triton.cdiv(n, BLOCK_N)
        wanted = min(
            triton.cdiv(TARGET_PROGRAMS, query_blocks), triton.cdiv(tiles, MIN_TILES_PER_SPLIT)
        )
    else:
        wanted = INTERPRET_SPLITS
    tiles_per_split = triton.cdiv(tiles, max(1, min(tiles, wanted)))
    splits = triton.cdiv(tiles, tiles_per_split)  # every split has at least one tile
    return block_k, block_d, splits, tiles_per_split


def fast_topk_triton(
    queries: torch.Tensor, fast_rows: torch.Tensor, sq_norms: torch.Tensor, k: int
) -> torch.Tensor:
    """Triton ``FastPass``: positions ``[n, k]`` int64 in ``[0, K)`` of the k smallest scores
    ``s = ||e||^2 - 2 <e, q>`` of each query (units: squared embedding units, minus ``||q||^2``).

    ``queries [n, d]`` (cast to fp32, then to the rows' dtype), ``fast_rows [K, d]`` fp32 or bf16,
    ``sq_norms [K]`` fp32, ``1 <= k <= K`` (ValueError otherwise), all on one CUDA device (or any
    device under ``TRITON_INTERPRET=1``). Rows are sorted by (score, position): exact score ties
    go to the lowest position. ``n = 0`` gives ``[0, k]``. ``k > MAX_TOPK`` runs the torch
    reference instead (register budget). See the module docstring for what "score" means in bf16.
    """
    _check(queries, fast_rows, sq_norms, k)
    if not (queries.is_cuda or interpret_requested()):
        raise ValueError(
            "fast_topk_triton needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
            "imported); default_fast_pass(device) picks the right pass"
        )
    import triton

    n, d = queries.shape
    K = fast_rows.shape[0]
    if n == 0:
        return torch.empty(0, k, dtype=torch.int64, device=queries.device)
    if k > MAX_TOPK:
        return fast_topk_torch(queries.to(torch.float32), fast_rows, sq_norms, k)
    # cast on the host, as torch does (round to nearest even; the interpreter's cast truncates)
    queries = queries.to(torch.float32).to(fast_rows.dtype).contiguous()
    fast_rows = fast_rows.contiguous()
    sq_norms = sq_norms.to(torch.float32).contiguous()
    k_pad = triton.next_power_of_2(k)
    block_k, block_d, splits, tiles_per_split = _plan(n, K, d, fast_rows.dtype, queries.device)
    keys = torch.empty(n, splits, k, dtype=torch.int64, device=queries.device)
    grid = (triton.cdiv(n, BLOCK_N), splits)
    _kernel(interpret_requested())[grid](
        queries, fast_rows, sq_norms, keys,
        n, K, d, k, tiles_per_split,
        queries.stride(0), fast_rows.stride(0), keys.stride(0), keys.stride(1),
        BLOCK_N=BLOCK_N, BLOCK_K=block_k, BLOCK_D=block_d, K_PAD=k_pad,
        PRECISION="ieee" if fast_rows.dtype == torch.float32 else "tf32",
        UPCAST=fast_rows.dtype != torch.float32 and interpret_requested(),
    )
    # keys are distinct (positions differ) and k <= K real keys exist: the k smallest are real
    best = keys.view(n, splits * k).topk(k, dim=1, largest=False, sorted=True).values
    return best & 0xFFFFFFFF


def default_fast_pass(device: torch.device | str) -> FastPass:
    """``fast_topk_triton`` for CUDA devices (or any device under ``TRITON_INTERPRET=1``) when
    triton is installed, ``fast_topk_torch`` otherwise; pass it as ``fast_pass`` to
    ``CandidateIndex.nearest`` / ``TokenPrivatizer``."""
    device = torch.device(device)
    if triton_available() and (device.type == "cuda" or interpret_requested()):
        return fast_topk_triton
    return fast_topk_torch
