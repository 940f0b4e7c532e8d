"""One layer's DP release of a private context, as served: collect rows, release once, answer.

Serving feeds K/V rows as the engine computes them (chunked prefill, several requests sharing
the same private prefix, recomputation after eviction): rows are stored by position, so a row
written twice is stored once, and the release happens exactly once, when all ``n`` rows are
present. The noise of KV head ``g`` of layer ``l`` comes from the keyed generator of
(context id, ``layer=l/kv_head=g``) with the *global* head index, so every tensor-parallel
layout and every restart releases the same structure: the noise is a function of the secret
key, the context and the head only, so a rebuild never draws fresh noise that could be averaged
away.

The local KV heads form one ``DPCrossAttention`` (answered in one batched contraction); each
head's budget is the model total split over ``budget_heads`` = layers x KV heads releases
(``scope="layer"`` composition) and its noise comes from its own keyed generator.
"""

from __future__ import annotations

import dataclasses

import torch

from ..privacy.keyed_noise import NoiseKey
from .core import DPCrossAttention
from .mapping import HeadMapping
from .merge import AttentionPart
from .params import DPAttentionParams


def noise_stream(layer: int, kv_head: int) -> str:
    """The keyed-noise stream name of one (layer, global KV head) release."""
    return f"attention/layer={layer}/kv_head={kv_head}"


def local_mapping(mapping: HeadMapping, heads: HeadLayout) -> HeadMapping:
    """``mapping`` restricted to the KV heads ``heads`` holds (their rows of ``key_center``)."""
    if mapping.key_center is None:
        return mapping
    rows = mapping.key_center[heads.kv_offset : heads.kv_offset + heads.kv_heads]
    return dataclasses.replace(mapping, key_center=rows)


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Which heads this process holds: KV heads ``[kv_offset, kv_offset + kv_heads)`` of the
    model's ``total_kv_heads``, with ``query_heads`` local query heads folded onto them."""

    kv_heads: int
    query_heads: int
    kv_offset: int
    total_kv_heads: int

    @staticmethod
    def for_rank(total_kv_heads: int, total_query_heads: int, tp_size: int, rank: int) -> HeadLayout:
        """vLLM's tensor-parallel split: KV heads are partitioned when ``total_kv_heads >= tp``
        and replicated (one per rank, shared by ``tp / total`` ranks) otherwise."""
        if total_kv_heads >= tp_size:
            kv_heads, offset = total_kv_heads // tp_size, rank * (total_kv_heads // tp_size)
        else:
            kv_heads, offset = 1, rank // (tp_size // total_kv_heads)
        return HeadLayout(kv_heads, total_query_heads // tp_size, offset, total_kv_heads)


class PrivateContextLayer:
    """Rows ``[0, n)`` of one layer's private context -> a keyed, once-only DP release.

    ``collect`` is the only method that sees exact K/V; ``release`` drops them. After that,
    ``answer`` is post-processing of the release. A layer the public gate closed (``open`` False:
    its release would carry noise, not information) collects nothing, is never released and
    spends nothing; its queries answer from the public rows alone.
    """

    def __init__(
        self,
        params: DPAttentionParams,
        mapping: HeadMapping,
        layer: int,
        heads: HeadLayout,
        head_dim: int,
        context_len: int,
        budget_heads: int,
        open: bool = True,
    ):
        if context_len > params.max_context:
            raise ValueError(
                f"private context of {context_len} tokens exceeds max_context={params.max_context}"
            )
        self.layer, self.heads, self.context_len, self.open = layer, heads, context_len, open
        self._dp = DPCrossAttention(
            params, local_mapping(mapping, heads), heads.kv_heads, head_dim, head_dim, heads.query_heads,
            budget_heads,
        )
        rows = context_len if open else 0
        self._k = torch.zeros(rows, heads.kv_heads, head_dim, dtype=torch.float64)
        self._v = torch.zeros_like(self._k)
        self._seen = torch.zeros(rows, dtype=torch.bool)

    @property
    def released(self) -> bool:
        return self._k is None

    @property
    def complete(self) -> bool:
        """All ``context_len`` rows collected (and not yet released; never for a closed layer)."""
        return self.open and self._k is not None and bool(self._seen.all())

    def collect(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows at ``positions: [T]`` (< context_len): ``k, v: [T, H_kv_local, d]``.
        A no-op once released: recomputed rows never enter a second release."""
        if not self.open or self.released or positions.numel() == 0:
            return
        pos = positions.cpu().long()
        self._k[pos] = k.detach().cpu().to(torch.float64)
        self._v[pos] = v.detach().cpu().to(torch.float64)
        self._seen[pos] = True

    def release(self, key: NoiseKey, context: str) -> None:
        """Build every local head's release with its keyed noise and drop the exact rows."""
        if not self.complete:
            raise RuntimeError(f"layer {self.layer}: {int(self._seen.sum())}/{self.context_len} rows")
        offset = self.heads.kv_offset
        generators = [key.generator(context, noise_stream(self.layer, offset + g)) for g in range(self.heads.kv_heads)]
        self._dp.build(self._k.transpose(0, 1), self._v.transpose(0, 1), generators)
        self._k = self._v = self._seen = None

    def answer(self, q: torch.Tensor) -> AttentionPart:
        """DP part for ``q: [m, H_q_local, d]``: ``out: [H_q_local, m, d]``, ``lse: [H_q_local, m]``
        (float64; true-logit scale, ready for ``merge_parts``)."""
        if not self.released:
            raise RuntimeError(f"layer {self.layer}: the private context is not released yet")
        return self._dp.query_parts(q.transpose(0, 1)).part()

    def relative_error_bound(self) -> float:
        """The public bound the gate reads (``DPCrossAttention.relative_error_bound``)."""
        return self._dp.relative_error_bound(self.context_len)

    def planned_mechanism(self):
        """The per-(layer, KV head) release this context gets (public)."""
        return self._dp.planned_mechanism(self.context_len)
