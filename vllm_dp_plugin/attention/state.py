"""The kernelised-state mechanism (spec 9 D5, "Mode C"): release ``P(K)^T [V | 1] + noise`` once.

``KernelStateBuilder`` accumulates the exact state chunk by chunk (chunked prefill) and is the
only holder of exact private data; ``release`` adds the noise once and returns a
``NoisyKernelState`` that answers any number of queries with one contraction: post-processing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..privacy.mechanisms import Mechanism

HeadGenerators = torch.Generator | Sequence[torch.Generator]  # one for all heads, or one per head


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
