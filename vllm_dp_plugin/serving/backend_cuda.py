"""CUDA: the DP path on vLLM's Triton backend, registered as ``CUSTOM``.

Select it with ``--attention-backend CUSTOM`` (every layer) or
``-ac.backend_per_kind '{"cross_attention": "CUSTOM"}'`` (cross-attention only). Same DP logic
as the CPU backend (``backend.DPImplMixin``); only the cache layout accessor differs.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from .backend import DPBuilderMixin, DPImplMixin


class DPTritonBuilder(DPBuilderMixin, TritonAttentionMetadataBuilder):
    _cudagraph_support = AttentionCGSupport.NEVER  # the DP path is eager Python


class DPTritonImpl(DPImplMixin, TritonAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._dp_init()

    def _paged_kv(self, kv_cache: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """Triton layout: ``[nb, H, bs, 2d]``, K and V split on the last dim."""
        return kv_cache.split(self.head_size, dim=-1)


class DPTritonBackend(TritonAttentionBackend):
    """``TRITON_ATTN`` with the DP path (pass-through when ``dp_privacy.attention`` is absent)."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return DPTritonImpl

    @staticmethod
    def get_builder_cls():
        return DPTritonBuilder
