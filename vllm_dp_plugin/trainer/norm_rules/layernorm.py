"""``nn.LayerNorm`` over the last dimension: weight ``gamma`` and bias ``beta``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import NormRule, ParamRole, features, norm_dtype, register_norm_rule, scaled_sum, wide
from .linear import BIAS


def layernorm_sq_norms(x: torch.Tensor, g: torch.Tensor, eps: float, bias: bool = True) -> torch.Tensor:
    """LayerNorm affine ``(gamma, beta)`` over the last dim: ``x: [B, T, d]`` its input,
    ``g: [B, T, d]``. ``g_gamma = sum_t g_t * xhat_t``, ``g_beta = sum_t g_t`` (``[B, d]``, cheap)."""
    dtype = norm_dtype(x, g)
    x, g = x.to(dtype), g.to(dtype)
    xhat = F.layer_norm(x, x.shape[-1:], eps=eps)
    out = (g * xhat).sum(1).pow(2).sum(-1)
    return out + g.sum(1).pow(2).sum(-1) if bias else out


def layernorm_hat(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    (x,) = wide(x)
    return F.layer_norm(x, module.normalized_shape, eps=module.eps)


@register_norm_rule(nn.LayerNorm)
class LayerNormRule(NormRule):
    name = "LayerNorm"
    roles = (
        ParamRole(
            "weight",
            lambda m, x, g, grams: layernorm_sq_norms(x, g, m.eps, bias=False),
            scaled_sum(layernorm_hat),
        ),
        BIAS,
    )

    def reference(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)

    def probe(self, module: nn.Module) -> torch.Tensor:
        return features(module, module.normalized_shape[0])

    def check_options(self, name: str, module: nn.Module) -> None:
        if len(module.normalized_shape) != 1:
            raise ValueError(f"layer norm {name!r}: only normalisation over the last dimension is supported")
