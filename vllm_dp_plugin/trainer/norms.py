"""Per-sample squared gradient norms from activations and output gradients (dpformer spec 3.2,
3.3, 3.6), never materialising a per-sample gradient of a large weight.

Every function takes, for one parameter use in the forward graph, the layer input ``a`` and
the gradient ``g`` of ``sum_i L_i`` w.r.t. the layer output (per sample, since nothing mixes
samples), batch-first ``[B, T, ...]``, and returns ``[B]``: ``||dL_i/dW||_F^2`` for each sample
``i``. All arithmetic is in float32 or wider (``norm_dtype``) even for bf16 inputs: an
underestimated norm breaks the clipping bound, i.e. the DP guarantee.
"""

from __future__ import annotations

import torch


def norm_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32, or float64 when any input is float64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def gram(x: torch.Tensor) -> torch.Tensor:
    """``x: [B, T, D]`` -> ``[B, T, T]`` per-sample Gram matrices."""
    return x @ x.transpose(1, 2)


def linear_sq_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Weight ``W [d_out, d_in]`` of ``y = a W^T``: ``a: [B, T, d_in]``, ``g: [B, T, d_out]``.

    Ghost norm ``<a a^T, g g^T>`` (``[B, T, T]`` Grams) when ``2 T^2 <= d_in d_out``, else the
    per-sample gradient ``g^T a`` itself (``[B, d_out, d_in]``, the smaller of the two)."""
    dtype = norm_dtype(a, g)
    a, g = a.to(dtype), g.to(dtype)
    tokens, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
    if 2 * tokens * tokens <= d_in * d_out:
        return (gram(a) * gram(g)).sum((1, 2))
    return torch.einsum("bto,bti->boi", g, a).pow(2).sum((1, 2))


def bias_sq_norms(g: torch.Tensor) -> torch.Tensor:
    """Bias of a linear layer: ``||sum_t g_t||^2``; ``g: [B, T, d_out]``."""
    return g.to(norm_dtype(g)).sum(1).pow(2).sum(-1)


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
    output ``z = h E^T`` (spec 3.2, corrected Eq. 4.1):
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


def layernorm_sq_norms(x: torch.Tensor, g: torch.Tensor, eps: float, bias: bool = True) -> torch.Tensor:
    """LayerNorm affine ``(gamma, beta)`` over the last dim: ``x: [B, T, d]`` its input,
    ``g: [B, T, d]``. ``g_gamma = sum_t g_t * xhat_t``, ``g_beta = sum_t g_t`` (``[B, d]``, cheap)."""
    dtype = norm_dtype(x, g)
    x, g = x.to(dtype), g.to(dtype)
    xhat = torch.nn.functional.layer_norm(x, x.shape[-1:], eps=eps)
    out = (g * xhat).sum(1).pow(2).sum(-1)
    return out + g.sum(1).pow(2).sum(-1) if bias else out


def rmsnorm_sq_norms(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm weight (Llama): ``g_gamma = sum_t g_t * x_t / rms(x_t)``; ``x, g: [B, T, d]``."""
    dtype = norm_dtype(x, g)
    x, g = x.to(dtype), g.to(dtype)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (g * normed).sum(1).pow(2).sum(-1)
