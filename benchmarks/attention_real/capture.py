"""Capturing and replacing a Hugging Face model's attention in ``python -m benchmarks.attention_real``: an
attention function registered with transformers (``prepare``) that delegates to the model's eager
attention, hooks that record (``Captured``) or replace (``Replace``) a layer's output, greedy decoding."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from benchmarks.attention_real.parts import (
    Condition,
    ExactParts,
    causal_tail,
    condition_parts,
    dp_part,
)
from vllm_dp_plugin.attention.merge import merge_parts

IMPL = "vllm_dp_attention_real"  # the attention function registered with transformers
_HOOK: Callable | None = None  # (layer, q, k, v, out, scaling) -> out, while a run wants it


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The model's own eager attention (``eager_attention_forward`` of its modeling module), then
    the active hook (capture or replace)."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    out, weights = eager(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if _HOOK is not None:
        out = _HOOK(int(module.layer_idx), query, key, value, out, float(scaling))
    return out, weights


def prepare(model) -> None:
    """Register ``IMPL`` (eager attention + hook, eager mask) and switch ``model`` to it."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(IMPL, _attention)
    AttentionMaskInterface.register(IMPL, eager_mask)
    model.set_attn_implementation(IMPL)
    if model.config._attn_implementation != IMPL:
        raise ValueError(f"{type(model).__name__} does not accept a custom attention function")
    model.eval()


class Hooked:
    """``with Hooked(fn):`` the attention hook is ``fn`` (not re-entrant)."""

    def __init__(self, fn: Callable | None) -> None:
        self.fn = fn

    def __enter__(self):
        global _HOOK
        if _HOOK is not None:
            raise RuntimeError("an attention hook is already active")
        _HOOK = self.fn
        return self

    def __exit__(self, *exc) -> None:
        global _HOOK
        _HOOK = None


@dataclass
class Captured:
    """One forward's per-layer tensors (float64, batch row 0): ``q`` and ``out`` (the model's own
    attention output) ``[H_q, m, d]`` of the forward's new rows, ``k``/``v`` ``[H_kv, L, d]`` of
    every row (cache included); ``scale``: the layers' softmax scale."""

    q: dict[int, torch.Tensor] = field(default_factory=dict)
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    out: dict[int, torch.Tensor] = field(default_factory=dict)
    scale: float | None = None

    def __call__(self, layer, query, key, value, out, scaling):
        self.q[layer] = query[0].detach().to(torch.float64)
        self.k[layer] = key[0].detach().to(torch.float64)
        self.v[layer] = value[0].detach().to(torch.float64)
        self.out[layer] = out[0].detach().transpose(0, 1).to(torch.float64)
        self.scale = scaling
        return out


class Replace:
    """Hook: batch row b's public rows (positions >= P) of every layer answered under
    ``conds[b]`` (None: the model's own attention). The context's rows are in the cache already,
    exact as in serving (the context is prefilled before any public query)."""

    def __init__(self, conds: Sequence[Condition | None], context_len: int, head: int,
                 releases: dict[int, dict]) -> None:
        self.conds, self.context_len, self.head, self.releases = list(conds), context_len, head, releases

    def __call__(self, layer, query, key, value, out, scaling):
        m, length = query.shape[2], key.shape[2]
        positions = torch.arange(length - m, length)
        if int(positions[0]) < self.context_len:
            raise RuntimeError("Replace answers public rows only: prefill the context first")
        if query.shape[0] != len(self.conds):
            raise ValueError(f"{query.shape[0]} batch rows for {len(self.conds)} conditions")
        out = out.clone()
        P = self.context_len
        allowed = causal_tail(positions, torch.arange(P, length))
        for b, cond in enumerate(self.conds):
            if cond is None:
                continue
            q, k, v = (x[b].to(torch.float64) for x in (query, key, value))
            exact = ExactParts(q, k[:, :P], v[:, :P], k[:, P:], v[:, P:], allowed, self.head, scaling)
            release = cond.release
            dp_parts = {} if release is None else {release: dp_part(self.releases[layer][release], q)}
            out[b] = merge_parts(*condition_parts(cond, exact, dp_parts)).out.transpose(0, 1).to(out.dtype)
        return out


def forward(model, ids: torch.Tensor, cache, hook: Callable | None, keep: int = 0):
    """Logits ``[B, m, vocab]`` (float64; the last ``keep`` positions only, all for 0) of ``ids:
    [B, m]`` after ``cache`` (extended in place) under ``hook``."""
    with torch.no_grad(), Hooked(hook):
        result = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=keep)
    return result.logits.to(torch.float64), result.past_key_values


def batched(cache, rows: int):
    """A copy of the batch-1 ``cache`` repeated over ``rows`` batch rows."""
    cache = copy.deepcopy(cache)
    if rows > 1:
        cache.batch_repeat_interleave(rows)
    return cache


def greedy(model, cache, logits: torch.Tensor, tokens: int, hook: Callable | None, eos: int | None) -> list[list[int]]:
    """Greedy continuation of every batch row: ``logits: [B, vocab]`` the next-token logits after
    ``cache`` (extended in place); ``tokens`` tokens a row, each row cut after its first ``eos``."""
    rows = [[] for _ in range(logits.shape[0])]
    for step in range(tokens):
        nxt = logits.argmax(-1)
        for row, token in zip(rows, nxt.tolist(), strict=True):
            row.append(token)
        if step + 1 == tokens or (eos is not None and all(eos in row for row in rows)):
            break
        logits, cache = forward(model, nxt[:, None], cache, hook)
        logits = logits[:, -1]
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]
