"""Prompt privatization core: token-level DP over a public embedding table. No vLLM import.

``EmbeddingTable`` (public geometry and sensitivities), ``token_mechanism`` (calibrated per-token
mechanisms with honest guarantees), ``CandidateIndex`` (nearest-candidate search) and
``TokenPrivatizer`` (masked prompt -> privatized ids or embeddings, plus a ``PrivacyReceipt``).

Per request (``session``: ``PromptPrivacy``, re-exporting its parts): ``options``, ``request``,
``segments`` (one pure segmentation step per prompt), ``history`` (the history cache),
``receipts``; ``lru``: the bounded LRU map they and the serving renderer use.
"""

from ..kernels.nearest_reference import fast_topk_torch
from .mechanisms import (
    MECHANISMS,
    AdditiveTokenMechanism,
    ExponentialMechanism,
    TokenGuarantee,
    TokenMechanism,
    token_mechanism,
)
from .nearest import CandidateIndex, brute_force_nearest
from .privatizer import PrivacyReceipt, TokenPrivatizer
from .table import EmbeddingTable

__all__ = [
    "MECHANISMS",
    "AdditiveTokenMechanism",
    "CandidateIndex",
    "EmbeddingTable",
    "ExponentialMechanism",
    "PrivacyReceipt",
    "TokenGuarantee",
    "TokenMechanism",
    "TokenPrivatizer",
    "brute_force_nearest",
    "fast_topk_torch",
    "token_mechanism",
]
