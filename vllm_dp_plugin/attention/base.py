"""The release-mode protocol of ``DPCrossAttention``: the types every mode implements or reads.

A mode decides how one layer's private context becomes a DP release and how queries read it;
``DPCrossAttention`` does everything else (feature map, head mapping, GQA folding, clamps,
accounting) the same way for every mode:

    add(k, v)    pk = P(mapped K): [H, n_c, F], weights = [mapped V | 1]: [H, n_c, W]
                 -> builder.add(pk, weights)          (builder = mode.builder(layer, device))
    finalize(g)  -> builder.release(mode.mechanism(layer, n), g): Release; the builder is dropped
    query(q)     (query features, release) = mode.query_path(layer, release) or the plain pair
                 -> release.answer(pq: [H, G m, F]) -> [H, G m, W]   (post-processing)

Modes are stateless: each method reads the layer's public configuration (``ReleaseContext``);
only the builder holds exact private rows, and only until ``release``. A new mode is one module
with a class satisfying ``ReleaseMode`` plus one entry in ``RELEASE_MODES`` (and its name in
``params.MODES``, which validates ``DPAttentionParams.mode``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from ..privacy.mechanisms import Mechanism
    from .accounting import StateSensitivity
    from .budget import TreeBudget
    from .features import FeatureMap
    from .mapping import HeadMapping
    from .params import DPAttentionParams
    from .tree_spec import TreeSpec

HeadGenerators = torch.Generator | Sequence[torch.Generator]  # one for all heads, or one per head


@runtime_checkable
class Release(Protocol):
    """A DP release of H KV heads (the noise is drawn): answering is post-processing."""

    def answer(self, pq: torch.Tensor) -> torch.Tensor:
        """``pq: [H, m, F]`` query features -> ``[H, m, W]`` (numerators | denominator)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes the release holds."""
        ...


@runtime_checkable
class ReleaseBuilder(Protocol):
    """The only holder of exact private data: the mapped rows seen so far."""

    def add(self, pk: torch.Tensor, weights: torch.Tensor) -> None:
        """One chunk: ``pk: [H, n_c, F]`` key features, ``weights: [H, n_c, W]`` = ``[V | 1]``."""
        ...

    def release(self, mechanism: Mechanism, generator: HeadGenerators) -> Release:
        """Draw the noise once (``mechanism``: the planned per-head release; ``generator``: one
        for all heads or one per head) and drop everything exact."""
        ...


class ReleaseContext(Protocol):
    """What a mode reads of its layer (``DPCrossAttention``): public configuration only."""

    params: DPAttentionParams
    mapping: HeadMapping
    features: FeatureMap
    kv_heads: int
    value_dim: int
    budget_heads: int

    def state_sensitivity(self) -> StateSensitivity: ...

    def tree_spec(self, n: int) -> TreeSpec: ...

    def tree_budget(self, n: int) -> TreeBudget: ...


QueryFeatures = Callable[[torch.Tensor, torch.dtype], torch.Tensor]  # [..., d] -> [..., F']
QueryPath = tuple[QueryFeatures, Release]  # a query feature map and the release re-indexed for it


@runtime_checkable
class ReleaseMode(Protocol):
    """One way to release a private context, registered by name in ``RELEASE_MODES``."""

    def query_dtype(self, layer: ReleaseContext) -> torch.dtype:
        """Precision of the query features and of the contraction."""
        ...

    def mechanism(self, layer: ReleaseContext, n: int) -> Mechanism:
        """The per-KV-head release a context of ``n`` rows gets (public: bounds, params, n)."""
        ...

    def planned_nbytes(self, layer: ReleaseContext, n: int) -> int:
        """Bytes the release of ``n`` rows is planned to hold, before building it."""
        ...

    def builder(self, layer: ReleaseContext, device: torch.device) -> ReleaseBuilder:
        """An empty builder for rows on ``device``."""
        ...

    def query_path(self, layer: ReleaseContext, release: Release) -> QueryPath | None:
        """A faster equivalent (query features, release) pair, post-processed from ``release``;
        None: queries use the layer's feature map on ``release`` itself."""
        ...
