"""Numbers of a load run: percentiles, per-group summaries, least-squares slopes."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, linear between closest ranks (numpy's
    default); None for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must lie in [0, 100], got {q!r}")
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(seconds: Sequence[float]) -> dict:
    """``{"n", "p50_ms", "p99_ms", "mean_ms", "max_ms"}`` of latencies in seconds (None values
    for no latencies)."""
    ms = [s * 1e3 for s in seconds]
    return {"n": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
            "mean_ms": sum(ms) / len(ms) if ms else None, "max_ms": max(ms) if ms else None}


def histogram(labels: Sequence[object]) -> dict[str, int]:
    """How often each label occurs, keys as strings, sorted."""
    return {str(k): v for k, v in sorted(Counter(str(x) for x in labels).items())}


def slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points (ValueError for fewer than
    two distinct x)."""
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} x values for {len(ys)} y values")
    n = len(xs)
    if n < 2:
        raise ValueError("a slope needs at least two points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a slope needs at least two distinct x values")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return b, my - b * mx
