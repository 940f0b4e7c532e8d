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
