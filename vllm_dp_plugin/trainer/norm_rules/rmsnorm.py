"""RMSNorm weight: ``torch.nn.RMSNorm`` and, by class name, every ``*RMSNorm`` with a
``weight`` parameter and ``variance_epsilon``/``eps`` (e.g. Llama's ``LlamaRMSNorm``)."""

from __future__ import annotations

import torch
from torch import nn

from .base import (
    NormRule,
    features,
    norm_dtype,
    per_sample_role,
    register_norm_rule,
    sq_norms_of,
    wide,
)


def rmsnorm_grads(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm weight (Llama), per sample: ``g_gamma = sum_t g_t * x_t / rms(x_t)``: ``[B, d]``
    for ``x, g: [B, T, d]``."""
    dtype = norm_dtype(x, g)
    x, g = x.to(dtype), g.to(dtype)
    inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [B, T, 1]
    return ((g * x).transpose(1, 2) @ inv_rms).squeeze(-1)


def rmsnorm_sq_norms(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """``[B]`` squared norms of ``rmsnorm_grads``."""
    return sq_norms_of(rmsnorm_grads(x, g, eps))


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
    roles = (per_sample_role("weight", lambda m, x, g: rmsnorm_grads(x, g, rms_eps(m, x))),)

    def reference(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return (module.weight * rms_hat(module, x)).to(x.dtype)

    def probe(self, module: nn.Module) -> torch.Tensor:
        return features(module, module.weight.shape[-1])
