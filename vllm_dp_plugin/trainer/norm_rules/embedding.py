"""``nn.Embedding``: the lookup norm (same-id mask, no one-hot), and Phantom Clipping for a table
tied to an output ``nn.Linear`` (the engine pairs the two uses)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import NormRule, ParamRole, gram, norm_dtype, register_norm_rule, wide


def lookup_sq_norms(ids: torch.Tensor, g: torch.Tensor, pad_id: int | None = None) -> torch.Tensor:
    """Embedding table used by one lookup ``e = E[ids]``: ``ids: [B, T]``, ``g: [B, T, d]`` the
    gradient at the raw lookup output. ``sum_{t,t'} [ids_t = ids_t' != pad] <g_t, g_t'>`` (the
    same-id mask replaces the one-hot product ``a_s a_s^T``; ``padding_idx`` rows get no gradient)."""
    g = g.to(norm_dtype(g))
    same = ids[:, :, None] == ids[:, None, :]  # [B, T, T]
    if pad_id is not None:
        valid = ids != pad_id
        same = same & valid[:, :, None] & valid[:, None, :]
    return (same * gram(g)).sum((1, 2))


def tied_embedding_sq_norms(
    ids: torch.Tensor,
    g_lookup: torch.Tensor,
    h: torch.Tensor,
    g_logits: torch.Tensor,
    pad_id: int | None = None,
) -> torch.Tensor:
    """Phantom Clipping: a table ``E [M, d]`` used by the input lookup ``e = E[ids]`` and the tied
    output ``z = h E^T`` (DPFormer's Eq. 4.1 corrected: it prints the first term squared and the
    cross term with the dimensionally impossible ``a_s^T grad_e_c``, which is a gather of rows at
    the input ids):
    ``||g_E||^2 = T_in + T_out + 2 T_cross`` with ``T_in`` the lookup norm, ``T_out = <h h^T,
    g_z g_z^T>`` and ``T_cross = sum_{t,t'} g_z[t', ids_t] <g_e[t], h_t'>`` (a token-id gather).

    ``ids: [B, T]``, ``g_lookup: [B, T, d]`` (gradient at the raw lookup output),
    ``h: [B, T', d]`` (the output layer's input), ``g_logits: [B, T', M]``."""
    dtype = norm_dtype(g_lookup, h, g_logits)
    g_lookup, h, g_logits = g_lookup.to(dtype), h.to(dtype), g_logits.to(dtype)
    t_in = lookup_sq_norms(ids, g_lookup, pad_id)
    t_out = (gram(h) * gram(g_logits)).sum((1, 2))
    picked = torch.gather(g_logits, 2, ids[:, None, :].expand(-1, g_logits.shape[1], -1))  # [B, T', T]
    cross = picked.transpose(1, 2) * (g_lookup @ h.transpose(1, 2))  # [B, T, T']
    if pad_id is not None:
        cross = cross * (ids != pad_id)[:, :, None]
    return t_in + t_out + 2.0 * cross.sum((1, 2))


def lookup_clipped_sum(module: nn.Module, ids: torch.Tensor, g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``index_add`` of the c-weighted lookup gradients into ``[num_embeddings, d]``; padding_idx
    rows get nothing."""
    (g,) = wide(g)
    out = torch.zeros(module.weight.shape, dtype=g.dtype, device=g.device)
    keep = ids != module.padding_idx if module.padding_idx is not None else torch.ones_like(ids, dtype=torch.bool)
    out.index_add_(0, ids[keep], (g * c[:, None, None].to(g.dtype))[keep])
    return out


@register_norm_rule(nn.Embedding)
class EmbeddingRule(NormRule):
    name = "Embedding"
    lookup = True
    roles = (ParamRole("weight", lambda m, ids, g, grams: lookup_sq_norms(ids, g, m.padding_idx), lookup_clipped_sum),)

    def reference(self, module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, module.weight, module.padding_idx)

    def probe(self, module: nn.Module) -> torch.Tensor:
        return torch.arange(min(4, module.num_embeddings), device=module.weight.device)[None]

    def check_options(self, name: str, module: nn.Module) -> None:
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ValueError(
                f"embedding {name!r}: max_norm, scale_grad_by_freq and sparse are not supported "
                "(they rescale rows or gradients across the batch)"
            )
