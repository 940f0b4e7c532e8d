"""``nn.LayerNorm`` over the last dimension: weight ``gamma`` and bias ``beta``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import NormRule, features, norm_dtype, per_sample_role, register_norm_rule, sq_norms_of
from .linear import BIAS, bias_sq_norms


def layernorm_grads(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm weight ``gamma`` over the last dim, per sample: ``g_gamma = sum_t g_t * xhat_t``:
    ``[B, d]`` for ``x: [B, T, d]`` its input, ``g: [B, T, d]``."""
    dtype = norm_dtype(x, g)
    x, g = x.to(dtype), g.to(dtype)
    return (g * F.layer_norm(x, x.shape[-1:], eps=eps)).sum(1)


def layernorm_sq_norms(x: torch.Tensor, g: torch.Tensor, eps: float, bias: bool = True) -> torch.Tensor:
    """``[B]``: LayerNorm affine ``(gamma, beta)`` (``g_beta = sum_t g_t``), or ``gamma`` alone."""
    out = sq_norms_of(layernorm_grads(x, g, eps))
    return out + bias_sq_norms(g) if bias else out


@register_norm_rule(nn.LayerNorm)
class LayerNormRule(NormRule):
    name = "LayerNorm"
    roles = (
        per_sample_role("weight", lambda m, x, g: layernorm_grads(x, g, m.eps)),
        BIAS,
    )

    def reference(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)

    def probe(self, module: nn.Module) -> torch.Tensor:
        return features(module, module.normalized_shape[0])

    def check_options(self, name: str, module: nn.Module) -> None:
        if len(module.normalized_shape) != 1:
            raise ValueError(f"layer norm {name!r}: only normalisation over the last dimension is supported")
