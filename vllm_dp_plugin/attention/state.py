"""The kernelised-state mechanism ("Mode C"): release ``P(K)^T [V | 1] + noise`` once.

For the softmax kernel the DPTree's answers are this linear-attention state read at P(q), plus
tree noise and an own-leaf bias: the trees, bins and the P_wx/Value cancellation only add noise.
Releasing the state directly is therefore far more accurate (not in the paper), and it is DP for
the whole state at once: all rows, all columns, any number of adaptive queries.

``KernelStateBuilder`` accumulates the exact state chunk by chunk (chunked prefill) and is the
only holder of exact private data; ``release`` adds the noise once and returns a
``NoisyKernelState`` that answers any number of queries with one contraction: post-processing.
``StateMode`` is the ``mode="state"`` entry of the release-mode registry (``modes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..privacy.mechanisms import Mechanism
from .accounting import state_mechanism
from .features import TaylorFeatures

if TYPE_CHECKING:
    from .base import HeadGenerators, QueryPath, ReleaseContext

TENSOR_POWER_DEGREE = 2  # state-mode Taylor queries up to this degree: one broadcast product,
# no gathers (E = 1 + d + d^2 columns vs r = binom(d + 2, 2); gathers cost more on CPU and GPU)


@dataclass
class NoisyKernelState:
    """The DP release: ``state: [H, F, W]`` float64 (W = d_v + 1, last column = denominator)
    and the public context length ``rows``."""

    state: torch.Tensor
    rows: int
    _cast: torch.Tensor | None = field(default=None, repr=False)  # the release in a query dtype

    def answer(self, pq: torch.Tensor) -> torch.Tensor:
        """pq: [H, m, F] query features -> [H, m, W] = (numerators | denominator), in pq's dtype
        (float32 queries contract a float32 copy of the float64 release: post-processing)."""
        return torch.bmm(pq, self._state_as(pq.dtype))

    def _state_as(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype == self.state.dtype:
            return self.state
        if self._cast is None or self._cast.dtype != dtype:
            self._cast = self.state.to(dtype)
        return self._cast

    @property
    def nbytes(self) -> int:
        return self.state.numel() * self.state.element_size()


class KernelStateBuilder:
    """Exact ``sum_j P(k_j) [v_j | 1]^T`` per head, float64, accumulated over chunks."""

    def __init__(self, heads: int, features: int, value_dim: int, device: torch.device | str = "cpu"):
        self._state = torch.zeros(heads, features, value_dim + 1, dtype=torch.float64, device=device)
        self.rows = 0

    def add(self, pk: torch.Tensor, weights: torch.Tensor) -> None:
        """pk: [H, n, F] key features; weights: [H, n, W] = [V | 1]."""
        self._state += torch.bmm(pk.transpose(1, 2).to(torch.float64), weights.to(torch.float64))
        self.rows += pk.shape[1]

    def release(self, mechanism: Mechanism, generator: HeadGenerators) -> NoisyKernelState:
        """Add i.i.d. ``mechanism`` noise to every state entry (drawn once, float64) and drop the
        exact state: after this call the builder holds nothing private. ``generator``: one for
        all heads, or one per head (head h's noise then depends on its own generator only)."""
        if self.rows == 0:
            raise ValueError("the private context is empty: add K/V before releasing")
        if isinstance(generator, torch.Generator):
            noise = mechanism.sample(tuple(self._state.shape), generator)
        else:
            if len(generator) != self._state.shape[0]:
                raise ValueError(f"{len(generator)} generators for {self._state.shape[0]} heads")
            head_shape = (1, *self._state.shape[1:])
            noise = torch.cat([mechanism.sample(head_shape, g) for g in generator])
        noise = noise.to(self._state.device)
        noisy = NoisyKernelState(self._state + noise, self.rows)
        self._state = None
        return noisy


class StateMode:
    """``mode="state"`` (``ReleaseMode``): the state accumulates chunk by chunk and is released
    once; queries contract it in ``params.query_dtype`` (Taylor degree <= 2: through the
    tensor-power expansion of the release, post-processing)."""

    def query_dtype(self, layer: ReleaseContext) -> torch.dtype:
        return getattr(torch, layer.params.query_dtype)

    def mechanism(self, layer: ReleaseContext, n: int) -> Mechanism:
        """Independent of ``n``: the sensitivity comes from the public bounds alone."""
        return state_mechanism(layer.params, layer.budget_heads, layer.state_sensitivity())

    def planned_nbytes(self, layer: ReleaseContext, n: int) -> int:
        """The float64 state ``[H, F, W]`` (``NoisyKernelState.nbytes``)."""
        return layer.kv_heads * layer.features.dim * (layer.value_dim + 1) * 8

    def builder(self, layer: ReleaseContext, device: torch.device) -> KernelStateBuilder:
        return KernelStateBuilder(layer.kv_heads, layer.features.dim, layer.value_dim, device)

    def query_path(self, layer: ReleaseContext, release: NoisyKernelState) -> QueryPath | None:
        features = layer.features
        if isinstance(features, TaylorFeatures) and features.degree <= TENSOR_POWER_DEGREE:
            expanded = features.expand_rows(release.state)  # post-processing
            return features.tensor_powers, NoisyKernelState(expanded, release.rows)
        return None
