"""Types shared by the kernels and their callers (the kernels package imports nothing else of
``vllm_dp_plugin``: it is the leaf every layer above may use)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class AttentionPart:
    """Attention over one key set: ``out: [..., d_v]`` its normalised output; ``lse: [...]`` the
    natural log of its softmax denominator ``sum_j exp(logit_j)`` in the true logit scale."""

    out: torch.Tensor
    lse: torch.Tensor


FastPass = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``(queries [n, d] fp32, fast_rows [K, d] fp32|bf16, sq_norms [K] fp32, k) -> [n, k] int64``:
positions of (a superset approximation of) the k smallest scores of each query."""

SelectPass = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(scores [n, K] fp32, slack [n] fp32, queries [n, d] fp32, rows [K, d] fp32) -> [n] int64``:
for each query, among the rows whose score is <= its minimum score + slack, the position of the
nearest by float64 ``direct_distances``; ties -> lowest position."""


@dataclass(frozen=True)
class Int8Rows:
    """Vectors ``v [m, d]`` (fp32 values) quantised for the certified int8 pass: ``codes [m, d]``
    int8 (queries in [-127, 127], rows in [-127, 127] or [-63, 63]: ``prompt.nearest``) and ``scale [m]`` float64, ``v ~ scale[:, None] * codes``; float64 ``[m]``:
    ``err = ||v - scale * codes||``, ``coded_norm = ||scale * codes||``, ``sq = ||v||^2``."""

    codes: torch.Tensor
    scale: torch.Tensor
    err: torch.Tensor
    coded_norm: torch.Tensor
    sq: torch.Tensor


Int8SelectPass = Callable[[torch.Tensor, Int8Rows, Int8Rows, float, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(gram [n, K] int32, queries' Int8Rows, rows' Int8Rows, margin, queries [n, d] fp32, rows [K, d] fp32)
-> [n] int64``: ``gram`` the exact integer products of the codes. Score of row k for query i:
``c = sq_k - 2 scale_k scale_i gram[i, k]``, within ``t = 2 (err_k ||r_i|| + coded_norm_k err_i)
+ margin (sq_k + sq_i)`` of the exact ``||e_k||^2 - 2 <e_k, r_i>``; among the rows with
``c - t <= min_k (c + t)``, the nearest by float64 ``direct_distances``; ties -> lowest position
(``prompt.nearest.certified_nearest_int8``)."""
