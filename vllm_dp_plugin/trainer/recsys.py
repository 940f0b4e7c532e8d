"""The DPFormer paper's sequential recommender with Re-Attention.

Where the paper is silent (LayerNorm placement, FFN width, masking, loss reduction), the choices
follow Vaswani et al. and SASRec. A SASRec-style Transformer encoder: item table
``nn.Embedding(M, d, padding_idx=0)`` scaled by ``sqrt(d)``, learned positions
``nn.Embedding(L, d)``, post-LN blocks (attention, residual, LayerNorm, ReLU FFN, residual,
LayerNorm), causal + key-padding mask with self always allowed, and an output
``nn.Linear(d, M, bias=False)`` whose weight IS the item table (tied, one Parameter), pad logit
masked. ``forward`` returns the per-sample loss ``[B]``: the mean NLL of a full softmax over all
items at the sample's valid positions.

DP-engine contract: parameters live only in ``nn.Embedding``/``nn.Linear``/``nn.LayerNorm``
modules, each module is called exactly once per forward, and the variance stream reads weights
under ``no_grad`` without calling modules (so it adds no gradient path and no hook call).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from .reattention import (
    ReAttentionConfig,
    attention_output_variance,
    head_linear_variance,
    layernorm_variance,
    linear_variance,
    logit_correction,
    relu_variance,
    residual_variance,
)

IGNORE = -100  # target of positions without a next item (padding)


def _layernorm_variance(
    ln: nn.LayerNorm, v_in: torch.Tensor, x: torch.Tensor, s2: float
) -> torch.Tensor:
    return layernorm_variance(v_in, x, ln.weight, ln.bias, ln.eps, s2)


class ReAttention(nn.Module):
    """Multi-head self-attention whose logits subtract ``min(||q_t||^2 v_K,j / (2 d_h), kappa)``
    (removing the inflation ``exp(||q_t||^2 v / (2 d_h))`` that key noise of variance v puts on
    the expected attention weight) when given a variance stream; without one it is plain scaled
    dot-product attention."""

    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        if d % heads:
            raise ValueError(f"d={d} is not divisible by heads={heads}")
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.heads, self.drop = heads, nn.Dropout(dropout)

    def _split(self, y: torch.Tensor) -> torch.Tensor:
        """``[B, T, d]`` -> ``[B, H, T, d_h]``."""
        b, t, d = y.shape
        return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        v_x: torch.Tensor | None,
        allowed: torch.Tensor,
        cfg: ReAttentionConfig | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x: [B, T, d]``, ``v_x: [B, T]`` or None (vanilla), ``allowed: [B, 1, T, T]`` bool with
        at least one True per row. Returns the output ``[B, T, d]`` and its variance ``[B, T]``."""
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if v_x is not None:
            s2 = cfg.block_variance()
            v_key = head_linear_variance(v_x, x, self.k.weight, s2, self.heads)
            logits = logits - logit_correction(q, v_key, cfg.max_corr).to(logits.dtype)
        probs = self.drop(torch.softmax(logits.masked_fill(~allowed, -math.inf), -1))
        ctx = (probs @ v).transpose(1, 2).flatten(2)
        out = self.o(ctx)
        if v_x is None:
            return out, None
        v_value = head_linear_variance(v_x, x, self.v.weight, s2, self.heads)
        v_ctx = attention_output_variance(probs, v_value).mean(1)  # heads concatenated: mean
        return out, linear_variance(v_ctx, ctx, self.o.weight, s2)


class PostLNBlock(nn.Module):
    """``x1 = LN(x + Drop(Attn(x)))``, ``x2 = LN(x1 + Drop(FF2(Drop(ReLU(FF1(x1))))))``."""

    def __init__(self, d: int, heads: int, d_ff: int, dropout: float):
        super().__init__()
        self.attn = ReAttention(d, heads, dropout)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff1, self.ff2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        v_x: torch.Tensor | None,
        allowed: torch.Tensor,
        cfg: ReAttentionConfig | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Shapes as ``ReAttention.forward``; the variance is propagated layer by layer (linear,
        ReLU and LayerNorm rules; residual branches add)."""
        a, v_a = self.attn(x, v_x, allowed, cfg)
        h1 = x + self.drop(a)
        x1 = self.ln1(h1)
        u = self.ff1(x1)
        r = self.drop(torch.relu(u))
        h2 = x1 + self.drop(self.ff2(r))
        x2 = self.ln2(h2)
        if v_x is None:
            return x2, None
        s2 = cfg.block_variance()
        v1 = _layernorm_variance(self.ln1, residual_variance(v_x, v_a), h1, s2)
        v_r = relu_variance(u, linear_variance(v1, x1, self.ff1.weight, s2))
        v_f = linear_variance(v_r, r, self.ff2.weight, s2)
        return x2, _layernorm_variance(self.ln2, residual_variance(v1, v_f), h2, s2)


class DPFormerRec(nn.Module):
    """DPFormer / vanilla sequential recommender over ``vocab_size`` ids (id ``pad_id`` = pad).

    ``reattention``: a ``ReAttentionConfig`` (its ``emb_scale`` is replaced by this model's
    ``sqrt(d)`` or 1) or None; None or ``enabled=False`` is the vanilla Transformer baseline, which
    runs exactly the plain computation (no variance stream). Defaults: the paper's d = 64, 1 head,
    2 blocks; FFN 4d and initialisation E ~ N(0, 1/d), P ~ N(0, 0.02^2), which it does not
    state."""

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        d: int = 64,
        heads: int = 1,
        n_blocks: int = 2,
        d_ff: int | None = None,
        dropout: float = 0.2,
        reattention: ReAttentionConfig | None = None,
        pad_id: int = 0,
        scale_emb: bool = True,
    ):
        super().__init__()
        self.item_emb = nn.Embedding(vocab_size, d, padding_idx=pad_id)
        self.pos_emb = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(
            PostLNBlock(d, heads, d_ff or 4 * d, dropout) for _ in range(n_blocks)
        )
        self.out = nn.Linear(d, vocab_size, bias=False)
        self.out.weight = self.item_emb.weight  # tied: one Parameter
        self.drop = nn.Dropout(dropout)
        self.pad_id, self.max_len = pad_id, max_len
        self.alpha = math.sqrt(d) if scale_emb else 1.0
        self._init_embeddings(d)
        self.reattention = self._checked(reattention)

    @torch.no_grad()
    def _init_embeddings(self, d: int) -> None:
        nn.init.normal_(self.item_emb.weight, std=d**-0.5)
        self.item_emb.weight[self.pad_id].zero_()
        nn.init.normal_(self.pos_emb.weight, std=0.02)

    def _checked(self, cfg: ReAttentionConfig | None) -> ReAttentionConfig | None:
        if cfg is None:
            return None
        if cfg.token_p.shape[0] != self.item_emb.num_embeddings:
            raise ValueError(
                f"token_p has {cfg.token_p.shape[0]} entries, the model {self.item_emb.num_embeddings} ids"
            )
        return replace(cfg, emb_scale=self.alpha)

    def set_noise(self, sigma_dp: float, batch_size: float) -> None:
        """Hand Re-Attention the DP-SGD noise multiplier and (expected) batch size the trainer
        uses; a no-op for a model built without a ``ReAttentionConfig``."""
        if self.reattention is not None:
            self.reattention = self.reattention.with_noise(sigma_dp, batch_size)

    @property
    def correcting(self) -> bool:
        """True when the forward pass runs the variance stream and the logit correction."""
        return self.reattention is not None and self.reattention.enabled

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids: [B, T]`` left-padded item ids (``T <= max_len``) -> final hidden ``[B, T, d]``.
        Pad positions are isolated by the mask (no query attends to them), so their states never
        reach a valid position."""
        b, t = ids.shape
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={self.max_len}")
        valid = ids != self.pad_id
        positions = torch.arange(t, device=ids.device).expand(b, t)
        x = self.drop(self.item_emb(ids) * self.alpha + self.pos_emb(positions))
        cfg = self.reattention if self.correcting else None
        v = cfg.input_variance(ids, valid) if cfg is not None else None
        allowed = _allowed_keys(valid)
        for block in self.blocks:
            x, v = block(x, v, allowed, cfg)
        return x

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Tied output scores with the pad logit at -inf: ``[..., d]`` -> ``[..., M]``."""
        z = self.out(h)
        pad = torch.arange(z.shape[-1], device=z.device) == self.pad_id
        return z.masked_fill(pad, -math.inf)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``ids, targets: [B, T]`` (target ``IGNORE`` = -100 where there is no next item) ->
        per-sample loss ``[B]``: mean NLL over the sample's valid positions (0 if none)."""
        z = self._logits(self.hidden(ids))
        nll = F.cross_entropy(z.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
        return nll.sum(1) / (targets != IGNORE).sum(1).clamp_min(1)

    def last_scores(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-item scores after the last position: ``ids: [B, T]`` -> ``[B, M]`` (pad = -inf);
        the same forward function as training (Re-Attention applies at evaluation too: the
        parameters are just as noisy there)."""
        h = self.hidden(ids)
        return self._logits(h[:, -1])


def _allowed_keys(valid: torch.Tensor) -> torch.Tensor:
    """``valid: [B, T]`` -> ``[B, 1, T, T]``: causal, non-pad keys, and the query itself always
    (so left-pad query rows are never all -inf: no NaN)."""
    t = valid.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=valid.device)
    return ((causal & valid[:, None, :]) | eye)[:, None]


__all__ = ["IGNORE", "DPFormerRec", "PostLNBlock", "ReAttention"]
