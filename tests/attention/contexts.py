"""A random private context for the attention tests (float64, seeded)."""

import torch


def random_context(heads: int, n: int, m: int, d: int, dv: int, seed: int = 0, query_heads: int | None = None):
    """``k: [heads, n, d]`` in [0, 1), ``v: [heads, n, dv]`` in [-1, 1), ``q: [query_heads, m, d]``
    in [0, 1) (``query_heads`` defaults to ``heads``)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.rand(heads, n, d, generator=g, dtype=torch.float64)
    v = torch.rand(heads, n, dv, generator=g, dtype=torch.float64) * 2 - 1
    q = torch.rand(query_heads or heads, m, d, generator=g, dtype=torch.float64)
    return k, v, q
