"""RMSNorm weight: ``torch.nn.RMSNorm`` and, by class name, every ``*RMSNorm`` with a
``weight`` parameter and ``variance_epsilon``/``eps`` (e.g. Llama's ``LlamaRMSNorm``)."""

from __future__ import annotations

import torch
from torch import nn

from .base import NormRule, ParamRole, features, norm_dtype, register_norm_rule, scaled_sum, wide


def rmsnorm_sq_norms(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm weight (Llama): ``g_gamma = sum_t g_t * x_t / rms(x_t)``; ``x, g: [B, T, d]``."""
    dtype = norm_dtype(x, g)
    x, g = x.to(dtype), g.to(dtype)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (g * normed).sum(1).pow(2).sum(-1)


def is_named_rmsnorm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), nn.Parameter)


def rms_eps(module: nn.Module, x: torch.Tensor) -> float:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return torch.finfo(x.dtype).eps if eps is None else float(eps)


def rms_hat(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    (x,) = wide(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + rms_eps(module, x))


@register_norm_rule(nn.RMSNorm, matches=is_named_rmsnorm)
class RMSNormRule(NormRule):
    name = "RMSNorm"
    roles = (ParamRole("weight", lambda m, x, g, grams: rmsnorm_sq_norms(x, g, rms_eps(m, x)), scaled_sum(rms_hat)),)

    def reference(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return (module.weight * rms_hat(module, x)).to(x.dtype)

    def probe(self, module: nn.Module) -> torch.Tensor:
        return features(module, module.weight.shape[-1])
