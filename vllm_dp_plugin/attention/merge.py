"""Combine attention over disjoint key sets into one softmax output, log-sum-exp safe.

A part is ``(out, lse)``: its normalised output ``out: [..., d_v]`` and ``lse: [...]``, the log
of its softmax denominator ``sum_j exp(logit_j)`` in the *true* logit scale. Softmax over the
union of key sets is the ``exp(lse)``-weighted mean of the parts' outputs (exact identity).
The DP part enters as ``private_part(num, den, log_scale)``: post-processing of the release.
"""

from __future__ import annotations

import torch

from ..kernels.types import AttentionPart

__all__ = ["AttentionPart", "exact_part", "merge_parts", "private_part"]


def private_part(num: torch.Tensor, den: torch.Tensor, log_scale: torch.Tensor) -> AttentionPart:
    """A DP answer ``num: [..., d_v]``, ``den: [...] > 0`` whose true sums are
    ``exp(log_scale) * (num, den)`` (e.g. ``log_scale = beta <q, mu_k>`` after key centring)."""
    if (den <= 0).any():
        raise ValueError("the private denominator must be > 0 (clamp it before merging)")
    return AttentionPart(num / den[..., None], torch.log(den) + log_scale)


def exact_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: float) -> AttentionPart:
    """Exact softmax attention over public keys. q: [H, m, d], k: [H, n, d], v: [H, n, d_v]."""
    logits = beta * torch.einsum("hmd,hnd->hmn", q, k)
    lse = torch.logsumexp(logits, dim=-1)
    return AttentionPart(torch.softmax(logits, dim=-1) @ v, lse)


def merge_parts(*parts: AttentionPart) -> AttentionPart:
    """Softmax attention over the union of the parts' keys."""
    lse = torch.stack([p.lse for p in parts])  # [P, ...]
    total = torch.logsumexp(lse, dim=0)
    weights = torch.exp(lse - total)[..., None]  # [P, ..., 1]
    out = sum(w * p.out for w, p in zip(weights, parts, strict=True))
    return AttentionPart(out, total)
