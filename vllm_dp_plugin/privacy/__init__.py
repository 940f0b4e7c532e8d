"""Privacy core: noise laws, calibrated mechanisms, accounting, keyed noise. No vLLM import."""

from .accountant import (
    COMPOSITIONS,
    Budget,
    PrivacyLedger,
    calibrate_noise_multiplier,
    split_budget,
)
from .keyed_noise import NoiseKey, context_id
from .mechanisms import (
    Mechanism,
    NotDifferentiallyPrivateWarning,
    gaussian_mechanism,
    laplace_mechanism,
    truncated_laplace_mechanism,
)
from .noise import GaussianNoise, LaplaceNoise, NoiseDistribution
from .trlaplace import pair_delta, sparse_pair_delta, trlaplace_mechanism, true_delta

__all__ = [
    "COMPOSITIONS",
    "Budget",
    "GaussianNoise",
    "LaplaceNoise",
    "Mechanism",
    "NoiseDistribution",
    "NoiseKey",
    "NotDifferentiallyPrivateWarning",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "context_id",
    "gaussian_mechanism",
    "laplace_mechanism",
    "pair_delta",
    "sparse_pair_delta",
    "split_budget",
    "trlaplace_mechanism",
    "true_delta",
    "truncated_laplace_mechanism",
]
