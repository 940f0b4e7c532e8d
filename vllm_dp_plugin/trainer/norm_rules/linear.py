"""``nn.Linear``: ghost norms of the weight, and the bias shared by every affine layer
(``BIAS``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import (
    InputGrams,
    NormRule,
    ParamRole,
    features,
    gram,
    norm_dtype,
    outer_sum,
    per_sample_role,
    register_norm_rule,
    sq_norms_of,
)


def linear_sq_norms(a: torch.Tensor, g: torch.Tensor, grams: InputGrams | None = None) -> torch.Tensor:
    """Weight ``W [d_out, d_in]`` of ``y = a W^T``: ``a: [B, T, d_in]``, ``g: [B, T, d_out]``.

    Ghost norm ``<a a^T, g g^T>`` (``[B, T, T]`` Grams; ``a a^T`` from ``grams``, shared with the
    other layers reading ``a``, when given) when ``2 T^2 <= d_in d_out``, else the per-sample
    gradient ``g^T a`` itself (``[B, d_out, d_in]``, the smaller of the two)."""
    dtype = norm_dtype(a, g)
    tokens, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
    g = g.to(dtype)
    if 2 * tokens * tokens <= d_in * d_out:
        a_gram = gram(a.to(dtype)) if grams is None else grams.of(a, dtype)
        return (a_gram * gram(g)).sum((1, 2))
    return torch.einsum("bto,bti->boi", g, a.to(dtype)).pow(2).sum((1, 2))


def bias_grads(g: torch.Tensor) -> torch.Tensor:
    """Bias of an affine layer, per sample: ``sum_t g_t``: ``[B, d_out]`` for ``g: [B, T, d_out]``."""
    return g.sum(1, dtype=norm_dtype(g))


def bias_sq_norms(g: torch.Tensor) -> torch.Tensor:
    """``[B]``: ``||sum_t g_t||^2``."""
    return sq_norms_of(bias_grads(g))


BIAS = per_sample_role("bias", lambda m, x, g: bias_grads(g))


@register_norm_rule(nn.Linear)
class LinearRule(NormRule):
    """``y = x W^T + b``, ``W [d_out, d_in]``."""

    name = "Linear"
    roles = (
        ParamRole("weight", lambda m, x, g, grams: linear_sq_norms(x, g, grams), lambda m, x, g, c: outer_sum(g, x, c)),
        BIAS,
    )

    def reference(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, module.weight, module.bias)

    def probe(self, module: nn.Module) -> torch.Tensor:
        return features(module, module.in_features)
