"""The low-order-bit distinguisher of an empirical audit (Mironov 2012): output sets of a float
release ``y`` of a scalar query whose neighbours answer 0 and ``c`` (a power of two), and the
test of the DP inequality on them.

``fl(c + z)`` is always a multiple of ``unit = ulp(c) / 2``: where |c + z| < c/2 the sum is exact
(Sterbenz) and z is a multiple of ulp(c)/2 there; elsewhere |c + z| >= c/2 has that spacing
itself. ``0 + z`` is not, whenever |z| < c/2 and z's last bits are set. The last significand
bit is biased the same way; the half-line above c/2 is the classic audit set (non-degenerate
under both neighbours, so the check is not vacuous for a release that hides the low bits).
"""

import math

import torch
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

MIRONOV = "not a multiple of ulp(c)/2"


def rdp_epsilon(noise_multiplier: float, delta: float) -> float:
    """epsilon at ``delta`` of one Gaussian release from its Renyi curve alpha / (2 s^2) at
    integer orders, which the discrete Gaussian of an integer shift shares."""
    accountant = rdp_privacy_accountant.RdpAccountant(orders=list(range(2, 256)))
    accountant.compose(dp_event.GaussianDpEvent(noise_multiplier))
    return accountant.get_epsilon(delta)


def events(c: float, dtype: torch.dtype) -> dict:
    """name -> predicate ``y: [n] -> bool [n]`` for float releases ``y`` of ``dtype``."""
    unit = c * torch.finfo(dtype).eps / 2  # ulp(c) / 2 for a power of two c
    as_int = {torch.float64: torch.int64, torch.float32: torch.int32}[dtype]
    return {
        MIRONOV: lambda y: torch.frac(y.double() / unit) != 0,
        "last significand bit set": lambda y: (y.view(as_int) & 1) == 1,
        "above c/2": lambda y: y.double() > c / 2,
    }


def excess(a: torch.Tensor, b: torch.Tensor, sets: dict, epsilon: float, delta: float, beta: float = 1e-6) -> dict:
    """Per output set E: max over the two directions of ``P^(E | a) - e^eps P^(E | b) - delta -
    (1 + e^eps) t``, ``a, b: [n]`` i.i.d. releases under two neighbours. t is the Hoeffding
    deviation sqrt(ln(4 |sets| / beta) / (2 n)) that all 4 |sets| one-sided estimates stay
    within with probability >= 1 - beta; so if the release is (epsilon, delta)-DP every excess
    is <= 0 with probability >= 1 - beta, and a positive one refutes it."""
    n = min(a.numel(), b.numel())
    t = math.sqrt(math.log(4 * len(sets) / beta) / (2 * n))
    slack = delta + (1 + math.exp(epsilon)) * t
    out = {}
    for name, member in sets.items():
        pa, pb = member(a).double().mean().item(), member(b).double().mean().item()
        out[name] = max(pa - math.exp(epsilon) * pb, pb - math.exp(epsilon) * pa) - slack
    return out
