"""Hugging Face ``Conv1D`` (GPT-2): ``y = x W + b`` with ``W [d_in, d_out]``, the transposed
``nn.Linear``. Matched by class name (transformers is not imported here)."""

from __future__ import annotations

import torch
from torch import nn

from .base import NormRule, ParamRole, features, outer_sum, register_norm_rule
from .linear import BIAS, linear_sq_norms


def is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


@register_norm_rule(matches=is_conv1d)
class Conv1DRule(NormRule):
    name = "Conv1D"
    roles = (
        ParamRole("weight", lambda m, x, g, grams: linear_sq_norms(x, g, grams), lambda m, x, g, c: outer_sum(x, g, c)),
        BIAS,
    )

    def reference(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x @ module.weight + module.bias

    def probe(self, module: nn.Module) -> torch.Tensor:
        return features(module, module.weight.shape[0])
