"""The norm-rule registry (by module type) and the arithmetic every rule shares.

A ``NormRule`` describes one supported module type: the forward its norms assume
(``reference``, checked once per hooked module against the module's own forward on ``probe``),
the options it refuses (``check_options``) and, per trainable parameter (``ParamRole``), the
per-sample squared gradient norm and the clip-weighted sum of per-sample gradients.

Shapes: ``x [B, T, d_in]`` (ids ``[B, T]`` for lookups), ``g [B, T, d_out]`` the gradient of
``sum_i L_i`` at the module output, ``c [B]`` clip factors. Norms are ``[B]``; sums have the
parameter's shape. All arithmetic is in float32 or wider (``norm_dtype``) even for bf16 inputs:
an underestimated norm breaks the clipping bound, i.e. the DP guarantee.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch
from torch import nn

SqNorms = Callable[[nn.Module, torch.Tensor, torch.Tensor, "InputGrams"], torch.Tensor]
ClippedSum = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


PerSample = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ParamRole:
    """One parameter (attribute ``attr``) of a supported module: ``sq_norms(module, x, g, grams)``
    -> ``[B]`` (``grams``: the backward's ``InputGrams``, for rules that use ``x x^T``) and
    ``clipped_sum(module, x, g, c)`` -> ``sum_b c_b dL_b/dparam``. ``per_sample(module, x, g)``
    -> ``[B, *shape]``, only for parameters whose per-sample gradients are small (``per_sample_role``):
    the engine then computes them once per use, for the norms and the clipped sum."""

    attr: str
    sq_norms: SqNorms
    clipped_sum: ClippedSum
    per_sample: PerSample | None = None


def sq_norms_of(per_sample: torch.Tensor) -> torch.Tensor:
    """``[B, ...]`` per-sample gradients -> ``[B]`` squared norms."""
    return per_sample.flatten(1).pow(2).sum(1)


def weighted_sum(per_sample: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``sum_b c_b per_sample_b``: the parameter's shape, from ``[B, ...]`` and ``c [B]``."""
    return torch.einsum("b,b...->...", c.to(per_sample.dtype), per_sample)


def per_sample_role(attr: str, grads: PerSample) -> ParamRole:
    """A parameter with small per-sample gradients ``grads(module, x, g)``: ``[B, *shape]`` (a bias,
    a norm layer's weight; float32 or wider): norms and clipped sum both from them."""
    return ParamRole(
        attr,
        lambda m, x, g, grams: sq_norms_of(grads(m, x, g)),
        lambda m, x, g, c: weighted_sum(grads(m, x, g), c),
        grads,
    )


class NormRule:
    """Base class of a supported module type's rule; subclass it in one small module per type
    and decorate the subclass with ``register_norm_rule``."""

    name: ClassVar[str]
    roles: ClassVar[tuple[ParamRole, ...]]
    lookup: ClassVar[bool] = False  # input is ids [B, ...] rather than features [B, ..., d]

    def reference(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The forward the norms assume."""
        raise NotImplementedError

    def probe(self, module: nn.Module) -> torch.Tensor:
        """An input to check ``module``'s forward against ``reference``."""
        raise NotImplementedError

    def check_options(self, name: str, module: nn.Module) -> None:
        """ValueError naming ``name`` if an option of ``module`` breaks the norms."""

    @property
    def attrs(self) -> frozenset[str]:
        return frozenset(role.attr for role in self.roles)

    def __repr__(self) -> str:
        return f"<norm rule {self.name}>"


_BY_TYPE: dict[type[nn.Module], NormRule] = {}
_BY_MATCH: list[tuple[Callable[[nn.Module], bool], NormRule]] = []
_RULES: list[NormRule] = []  # registration order (the order error messages list them in)

R = TypeVar("R", bound=type[NormRule])


def register_norm_rule(
    *module_types: type[nn.Module], matches: Callable[[nn.Module], bool] | None = None
) -> Callable[[R], R]:
    """Class decorator: register an instance of the decorated ``NormRule`` subclass for
    ``module_types`` (subclasses included: the nearest registered type in the MRO wins) and, for
    duck-typed classes of libraries that are not imported (Hugging Face ``Conv1D``, Llama's
    ``LlamaRMSNorm``), for every module ``matches`` accepts (tried after the types)."""
    if not module_types and matches is None:
        raise ValueError("register_norm_rule needs module types or a matches predicate")

    def register(cls: R) -> R:
        rule = cls()
        for module_type in module_types:
            if module_type in _BY_TYPE:
                raise ValueError(f"{module_type.__qualname__} already has a norm rule ({_BY_TYPE[module_type].name})")
            _BY_TYPE[module_type] = rule
        if matches is not None:
            _BY_MATCH.append((matches, rule))
        _RULES.append(rule)
        return cls

    return register


def find_rule(module: nn.Module) -> NormRule | None:
    """The rule of ``module``'s type (nearest registered class in its MRO, then the
    predicates in registration order), None if unsupported."""
    for cls in type(module).__mro__:
        rule = _BY_TYPE.get(cls)
        if rule is not None:
            return rule
    return next((rule for matches, rule in _BY_MATCH if matches(module)), None)


def rule_for(module: nn.Module) -> NormRule:
    """``find_rule``, or ValueError naming the unsupported module type."""
    rule = find_rule(module)
    if rule is None:
        cls = type(module)
        raise ValueError(
            f"no per-sample norm rule for module type {cls.__name__} ({cls.__module__}.{cls.__qualname__}); "
            f"supported: {', '.join(supported_names())}"
        )
    return rule


def registered_rules() -> tuple[NormRule, ...]:
    """Every registered rule, in registration order."""
    return tuple(_RULES)


def supported_names() -> list[str]:
    return [rule.name for rule in _RULES]


# ---------- shared arithmetic ----------


def norm_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32, or float64 when any input is float64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def gram(x: torch.Tensor) -> torch.Tensor:
    """``x: [B, T, D]`` -> ``[B, T, T]`` per-sample Gram matrices."""
    return x @ x.transpose(1, 2)


class InputGrams:
    """Per-sample Grams ``x x^T`` of layer inputs, each computed once per distinct input in one
    backward: layers that read the same tensor (Llama's q/k/v projections read one normed hidden
    state, gate/up another) share one Gram. Sameness is read off the tensors, never off module
    names: the same storage, offset, shape, strides, dtype, device and version counter (an
    in-place write in between changes the version), i.e. the same values. Every keyed input is
    held until the memo is dropped, so no freed storage's address can come back under a live key."""

    def __init__(self) -> None:
        self._grams: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def of(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x: [B, T, D]`` -> ``gram(x.to(dtype))``: ``[B, T, T]``."""
        key = (x.untyped_storage().data_ptr(), x.storage_offset(), x.shape, x.stride(), x.dtype, x.device,
               x._version, dtype)
        if key not in self._grams:
            self._grams[key] = (x, gram(x.to(dtype)))
        return self._grams[key][1]


def wide(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors in their common norm dtype (float32, or float64 if any is float64)."""
    dtype = norm_dtype(*tensors)
    return [t.to(dtype) for t in tensors]


def outer_sum(left: torch.Tensor, right: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``sum_b c_b left_b^T right_b``: ``[d_left, d_right]`` for ``left: [B, T, d_left]``,
    ``right: [B, T, d_right]``. The factor scales the narrower operand, so no copy of a wide
    output gradient (logits ``[B, T, V]``) is made beyond the float32 cast."""
    left, right = wide(left, right)
    if left.shape[-1] <= right.shape[-1]:
        left = left * c[:, None, None].to(left.dtype)
    else:
        right = right * c[:, None, None].to(right.dtype)
    return left.flatten(0, 1).T @ right.flatten(0, 1)


def features(module: nn.Module, dim: int) -> torch.Tensor:
    """A ``[2, 3, dim]`` probe input in the module's dtype and device (fixed seed)."""
    weight = next(module.parameters())
    probe = torch.randn(2, 3, dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return probe.to(device=weight.device, dtype=weight.dtype)
