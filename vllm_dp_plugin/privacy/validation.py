"""Input checks shared by every mechanism and accountant.

Each check raises ``ValueError`` with a message naming the offending parameter, so a bad
configuration fails before any noise is drawn or any budget is recorded.
"""

from __future__ import annotations

import math


def check_epsilon(epsilon: float, name: str = "epsilon") -> float:
    """Return ``epsilon`` as float; raise unless it is finite and > 0."""
    value = _as_finite_float(epsilon, name)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {epsilon!r}")
    return value


def check_delta(delta: float, name: str = "delta", *, allow_zero: bool = False) -> float:
    """Return ``delta`` as float; raise unless it lies in (0, 1) (or [0, 1) with allow_zero)."""
    value = _as_finite_float(delta, name)
    low_ok = value >= 0 if allow_zero else value > 0
    if not (low_ok and value < 1):
        interval = "[0, 1)" if allow_zero else "(0, 1)"
        raise ValueError(f"{name} must lie in {interval}, got {delta!r}")
    return value


def check_positive(value: float, name: str) -> float:
    """Return ``value`` as float; raise unless it is finite and > 0 (sensitivities, bounds)."""
    out = _as_finite_float(value, name)
    if out <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return out


def check_count(value: int, name: str) -> int:
    """Return ``value``; raise unless it is an int >= 1 (layers, heads, releases)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _as_finite_float(value: float, name: str) -> float:
    # ValueError (not TypeError) for every bad value: callers catch one exception type.
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")  # noqa: TRY004
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out
