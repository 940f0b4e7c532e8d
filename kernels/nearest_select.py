"""The selection step of the certified fp32 and int8 nearest-candidate searches, fused for CPU (C++ via
``cpu_extension``), beside its torch reference ``nearest_reference.select_within_bound``.

``select_within_bound(scores, slack, queries, rows)``: ``scores [n, K]`` fp32 GEMM scores
``||e||^2 - 2 <e, r>``, ``slack [n]`` fp32, ``queries [n, d]``, ``rows [K, d]`` fp32. For each
query, among the rows whose score is within ``slack`` of the query's best, the nearest by float64
``||e - r||^2``, ties -> lowest position: ``[n]`` int64, the reference's contract. One pass over
each query's scores instead of five torch passes over the whole matrix.

``default_select(device)``: this kernel for CPU tensors when it builds, the torch reference
otherwise (CUDA, no compiler). ``select_int8`` / ``default_select_int8``: the same for the int8
pass's integer scores and per-pair bounds (``types.Int8SelectPass``).
"""

from __future__ import annotations

import torch

from .cpu_extension import load
from .nearest_reference import select_int8 as select_int8_torch
from .nearest_reference import select_within_bound as select_torch
from .types import Int8Rows, Int8SelectPass, SelectPass


def _extension():
    return load("nearest_select.cpp")


def select_within_bound(
    scores: torch.Tensor, slack: torch.Tensor, queries: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """The fused CPU ``SelectPass`` (needs the extension: ``default_select`` checks). Raises
    ValueError on non-finite scores (the torch reference cannot answer those either)."""
    try:
        return _extension().select_within_bound(
            scores.float().contiguous(), slack.float().contiguous(),
            queries.float().contiguous(), rows.float().contiguous(),
        )
    except RuntimeError as err:
        raise ValueError(str(err).splitlines()[0]) from None


def select_int8(
    gram: torch.Tensor, q: Int8Rows, r: Int8Rows, margin: float, queries: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """The fused CPU ``Int8SelectPass`` (needs the extension: ``default_select_int8`` checks).
    Raises ValueError on non-finite scores."""
    try:
        return _extension().select_int8(
            gram.contiguous(), q.scale, q.err, q.sq, r.scale, r.err, r.coded_norm, r.sq, float(margin),
            queries.float().contiguous(), rows.float().contiguous(),
        )
    except RuntimeError as err:
        raise ValueError(str(err).splitlines()[0]) from None


def default_select(device: torch.device | str = "cpu") -> SelectPass:
    """The fused CPU selection for ``device`` cpu when it is built, else the torch reference."""
    if torch.device(device).type == "cpu" and _extension() is not None:
        return select_within_bound
    return select_torch


def default_select_int8(device: torch.device | str = "cpu") -> Int8SelectPass:
    """The fused CPU int8 selection for ``device`` cpu when it is built, else the torch reference."""
    if torch.device(device).type == "cpu" and _extension() is not None:
        return select_int8
    return select_int8_torch
