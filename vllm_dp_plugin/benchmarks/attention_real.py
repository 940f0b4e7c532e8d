"""``vllm-dp bench attention-real``: why DP attention garbles a real chat model's answers, offline.

The context benchmark's scenarios (``bench context``: documents as the chat template's system turn
``C`` = positions [0, P), then a user turn with a question) run through the Hugging Face model in
float32 with eager attention. Every decoder layer's post-RoPE queries, keys and values are taken
from transformers' attention dispatch (a function registered with ``AttentionInterface`` that
delegates to the model's own eager attention, so the model's outputs are unchanged), and each
layer is measured in isolation, with exact inputs, for the public queries (the user-turn tokens,
positions >= P):

1. **sinks**: the exact attention mass on position 0, on the public head [0, h) (the chat
   template's system header ``<|im_start|>system\\n``, h = 3 on SmolLM2; ``serving.context``'s
   ``public_head: auto`` rule), on the rest of the private span [h, P) and on the public tail
   [P, p];
2. **kernel** (noise off): the DP part over the private span, [0, P) (``bare``) and [h, P)
   (``head``), built from the plan (``ContextPlan``: the calibration's mapping, the layer's Taylor
   degree, clamps) as ``DPCrossAttention`` with the release's noise left out
   (``NoiselessAttention``), against exact softmax attention over the same rows: the output's
   relative error and ``|log den_dp - log den|``; ``mapping`` is exact softmax over the mapped
   (centred, clipped) rows, which separates the clipping from the Taylor truncation;
3. **noise**: the same with the plan's noise at each ``--eps`` (``pld`` composition, as served),
   and the ratio of the denominator's noise std ``sigma ||P(q)||`` to the true denominator;
4. **merged output**: the relative error of the layer's attention output (``merge_parts`` of
   the DP part, the exact public head and the exact public tail, as served) against exact full
   attention, per condition: ``exact`` (exact private part: ~0), ``kernel_bare``,
   ``kernel_head``, ``eps<E>_head``, ``eps<E>_bare`` and ``dropped`` (public head and tail only:
   what a closed gate gives).

End to end (``propagated``): the same conditions in every layer at once (the context's own rows
stay exact, as in serving: the context is prefilled before any public query), teacher-forced on
the exact model's greedy answer (``--answer-tokens``): top-1 agreement with it and the mean
KL(exact || condition) of the next-token distributions; with ``--answers`` also each condition's
own greedy answers, scored as ``bench context`` scores them (batched decoding over a cached
800-token context: slow on CPU, about 8 s a step on 2 busy cores).

The token layout, the scenarios, the model import and the cached calibration are ``bench
context``'s (``benchmarks.lib.scenarios``: ``ChatLayout``, ``load_scenarios``, ``ensure_model``,
``cached_calibration``): this suite measures exactly the sequences that suite serves. The releases are built per scenario
(state mode: the noise does not depend on the context length, so the plan's numbers are the same
for every scenario). Nothing here imports vllm.

Writes ``attention-real-<device>-<date>.{md,json,png}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vllm_dp_plugin.attention.core import DPCrossAttention
from vllm_dp_plugin.attention.merge import AttentionPart, merge_parts
from vllm_dp_plugin.benchmarks.lib.cli import (
    add_date_arg,
    add_out_arg,
    command_line,
    floats,
    ints,
    parse,
    today,
)
from vllm_dp_plugin.benchmarks.lib.environment import device_label, environment
from vllm_dp_plugin.benchmarks.lib.progress import logger
from vllm_dp_plugin.benchmarks.lib.report import (
    fmt,
    pyplot,
    save_figure,
    suffixed,
    table,
    write_json,
    write_text,
)
from vllm_dp_plugin.config import AttentionPrivacyConfig
from vllm_dp_plugin.plan import ContextPlan, ModelShape, layer_mapping
from vllm_dp_plugin.privacy.mechanisms import Mechanism
from vllm_dp_plugin.privacy.noise import NoiseDistribution

IMPL = "vllm_dp_attention_real"  # the attention function registered with transformers
DEFAULT_EPS = (8.0, 64.0)
DEFAULT_LIMIT = 4
ANSWER_TOKENS = 16
DELTA = 1e-6
MAX_CURVE_EPS = 100.0  # pld accounting refuses larger eps (config.MAX_CURVE_EPSILON): basic beyond


# =========================================================================== conditions
@dataclass(frozen=True)
class Condition:
    """How the public queries see the private span: ``head`` keeps [0, h) public and exact; ``dp``
    is the private part: ``exact`` softmax, ``kernel`` (the plan's DP part, noise off), ``noisy``
    (at ``eps``) or None (no private part: a closed gate)."""

    name: str
    head: bool
    dp: str | None
    eps: float | None = None

    @property
    def release(self) -> tuple[bool, float | None] | None:
        """The release this condition reads: (head, eps; None = noise off), or None."""
        if self.dp == "kernel":
            return (self.head, None)
        if self.dp == "noisy":
            return (self.head, self.eps)
        return None


def conditions(eps: Sequence[float]) -> list[Condition]:
    out = [Condition("exact", True, "exact"), Condition("kernel_bare", False, "kernel"),
           Condition("kernel_head", True, "kernel")]
    out += [Condition(f"eps{e:g}_head", True, "noisy", e) for e in eps]
    out += [Condition(f"eps{e:g}_bare", False, "noisy", e) for e in eps]
    return [*out, Condition("dropped", True, None)]


# =========================================================================== exact attention
def keys_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: float,
              allowed: torch.Tensor | None = None) -> AttentionPart:
    """Exact softmax attention of ``q: [H_q, m, d]`` over the rows of ``k, v: [H_kv, n, d]`` (GQA:
    query head h reads KV head h // G), float64; ``allowed: [m, n]``: which rows each query sees
    (every query must see one). An ``AttentionPart`` (out [H_q, m, d], lse [H_q, m])."""
    logits = keys_logits(q, k, beta)
    if allowed is not None:
        logits = logits.masked_fill(~allowed[None], -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.exp(logits - lse[..., None])
    kv_heads, (heads, m, n) = k.shape[0], weights.shape
    out = torch.bmm(weights.reshape(kv_heads, heads // kv_heads * m, n), v.to(torch.float64))
    return AttentionPart(out.reshape(heads, m, -1), lse)


def keys_logits(q: torch.Tensor, k: torch.Tensor, beta: float) -> torch.Tensor:
    """``beta <q_i, k_j>``: [H_q, m, n] float64 (GQA: the G query heads of a KV head batched)."""
    (heads, m, d), kv_heads = q.shape, k.shape[0]
    grouped = q.to(torch.float64).reshape(kv_heads, heads // kv_heads * m, d)
    return (beta * torch.bmm(grouped, k.to(torch.float64).transpose(1, 2))).reshape(heads, m, -1)


def _kv_index(query_heads: int, kv_heads: int) -> torch.Tensor:
    return torch.arange(query_heads) // (query_heads // kv_heads)


def rel_sq(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(||x - ref||^2, ||ref||^2): pooled into a relative Frobenius error over many calls."""
    return float((x - ref).pow(2).sum()), float(ref.pow(2).sum())


class ExactParts:
    """Exact attention parts of public queries ``q: [H_q, m, d]``, each computed once when first
    asked: over rows [start, end) of the context ``ctx_k, ctx_v: [H_kv, P, d]`` (``span``;
    ``head_part`` = [0, h), ``private(start)`` = [start, P)) and over the public tail
    ``tail_k, tail_v: [H_kv, t, d]`` with ``tail_allowed: [m, t]`` (each query sees its own
    sequence's tail rows up to its position)."""

    def __init__(self, q, ctx_k, ctx_v, tail_k, tail_v, tail_allowed, head: int, beta: float) -> None:
        self.q, self.ctx_k, self.ctx_v, self.tail_k, self.tail_v = q, ctx_k, ctx_v, tail_k, tail_v
        self.tail_allowed, self.head, self.beta = tail_allowed, head, beta
        self.context_len = ctx_k.shape[1]
        self._parts: dict = {}

    def span(self, start: int, end: int) -> AttentionPart:
        if (start, end) not in self._parts:
            self._parts[(start, end)] = keys_part(self.q, self.ctx_k[:, start:end], self.ctx_v[:, start:end],
                                                  self.beta)
        return self._parts[(start, end)]

    @property
    def tail(self) -> AttentionPart:
        if "tail" not in self._parts:
            self._parts["tail"] = keys_part(self.q, self.tail_k, self.tail_v, self.beta, self.tail_allowed)
        return self._parts["tail"]

    @property
    def head_part(self) -> AttentionPart:
        return self.span(0, self.head)

    def private(self, start: int) -> AttentionPart:
        return self.span(start, self.context_len)

    def full(self) -> AttentionPart:
        """Exact attention over every row the queries see (the merge is an exact identity)."""
        return merge_parts(*([self.head_part] if self.head else []), self.private(self.head), self.tail)


def causal_tail(positions: torch.Tensor, tail_positions: torch.Tensor) -> torch.Tensor:
    """``[m, t]``: tail row j is visible to the query at ``positions[i]`` iff it is not later."""
    return tail_positions[None, :] <= positions[:, None]


def condition_parts(cond: Condition, exact: ExactParts, dp_parts: dict) -> list[AttentionPart]:
    """The attention parts the public queries merge under ``cond``: the exact tail, the exact
    public head (``cond.head``) and last the private part (exact, or ``dp_parts[cond.release]``:
    the DP release read at the queries)."""
    parts = [exact.tail]
    if cond.head and exact.head:
        parts.append(exact.head_part)
    if cond.dp == "exact":
        parts.append(exact.private(exact.head if cond.head else 0))
    elif cond.dp is not None:
        parts.append(dp_parts[cond.release])
    return parts


# =========================================================================== the plan's DP part
class NoNoise(NoiseDistribution):
    """Zero noise: what the feature map alone does (a measurement, never a release)."""

    def sample(self, shape, generator: torch.Generator) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float64, device=generator.device)

    def cdf(self, x):
        return (np.asarray(x, dtype=np.float64) >= 0).astype(np.float64)

    @property
    def variance(self) -> float:
        return 0.0

    @property
    def bound(self) -> float:
        return 0.0


class NoiselessAttention(DPCrossAttention):
    """``DPCrossAttention`` whose release leaves the planned noise out: the plan's mapping,
    feature map and clamps alone."""

    def planned_mechanism(self, n: int) -> Mechanism:
        return dataclasses.replace(super().planned_mechanism(n), noise=NoNoise())


def plan_attention(plan: ContextPlan, layer: int, noise: bool = True) -> DPCrossAttention:
    """Layer ``layer`` of ``plan`` for all its heads: the ``DPCrossAttention`` that ``plan.layer``
    builds inside ``PrivateContextLayer`` (same parameters, mapping and budget split), always open
    (the gate is what is being measured); ``noise=False``: ``NoiselessAttention``."""
    cls = DPCrossAttention if noise else NoiselessAttention
    return cls(plan.layer_params(layer), layer_mapping(plan.cfg, plan.kind, layer, plan.beta), plan.total_kv_heads,
               plan.head_dim, plan.head_dim, plan.total_query_heads, plan.budget_heads)


def make_config(eps: float, calibration: str | None = None, bounds: dict | None = None) -> AttentionPrivacyConfig:
    """The served configuration of one eps (``bench context``'s: pld up to eps 100, then basic),
    gate off."""
    return AttentionPrivacyConfig(epsilon=eps, delta=DELTA, composition="pld" if eps <= MAX_CURVE_EPS else "basic",
                                  calibration=calibration, bounds=bounds, gate=False)


@dataclass
class Plans:
    """One ``ContextPlan`` per (public head?, eps) of one scenario's private span; eps None reads
    the first eps's plan (its noise is left out)."""

    by_key: dict[tuple[bool, float], ContextPlan]
    eps: tuple[float, ...]

    @staticmethod
    def of(shape: ModelShape, context_len: int, head: int, eps: Sequence[float], calibration: str | None = None,
           bounds: dict | None = None) -> Plans:
        plans = {}
        for e in eps:
            cfg = make_config(e, calibration, bounds)
            plans[(True, e)] = ContextPlan.of(cfg, shape, "self_attention", context_len - head, public_head=head)
            plans[(False, e)] = ContextPlan.of(cfg, shape, "self_attention", context_len)
        return Plans(plans, tuple(eps))

    def plan(self, head: bool, eps: float | None) -> ContextPlan:
        return self.by_key[(head, self.eps[0] if eps is None else eps)]

    def releases(self) -> list[tuple[bool, float | None]]:
        """Every (public head?, eps) release the measurements read (eps None: noise off)."""
        return [(public, eps) for public in (False, True) for eps in (None, *self.eps)]


def build_releases(plans: Plans, layer: int, k: torch.Tensor, v: torch.Tensor, head: int,
                   seed: int) -> dict[tuple[bool, float | None], DPCrossAttention]:
    """(public head?, eps) -> layer ``layer``'s DP release built from the context rows ``k, v:
    [H_kv, P, d]`` (rows [head, P), or [0, P) without a public head); eps None: noise off. The
    noise comes from a generator seeded by (seed, layer, release)."""
    out = {}
    for i, (public, eps) in enumerate(plans.releases()):
        dp = plan_attention(plans.plan(public, eps), layer, noise=eps is not None)
        start = head if public else 0
        generator = torch.Generator().manual_seed(seed * 1_000_003 + layer * 101 + i)
        out[(public, eps)] = dp.build(k[:, start:], v[:, start:], generator)
    return out


def dp_part(dp: DPCrossAttention, q: torch.Tensor) -> AttentionPart:
    """The DP part of ``q: [H_q, m, d]`` read from a built release (float64)."""
    part = dp.query_parts(q).part()
    return AttentionPart(part.out.to(torch.float64), part.lse.to(torch.float64))


# =========================================================================== capture
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


# =========================================================================== per-layer measures
class LayerStats:
    """Pooled measurements of one layer over every public query of the run."""

    def __init__(self) -> None:
        self.sq: dict[str, list[float]] = {}  # name -> [sum sq err, sum sq ref]
        self.values: dict[str, list[torch.Tensor]] = {}  # name -> flattened samples

    def add_sq(self, name: str, pair: tuple[float, float]) -> None:
        acc = self.sq.setdefault(name, [0.0, 0.0])
        acc[0] += pair[0]
        acc[1] += pair[1]

    def add(self, name: str, x: torch.Tensor) -> None:
        self.values.setdefault(name, []).append(x.detach().flatten().to(torch.float64))

    def rel(self, name: str) -> float | None:
        if name not in self.sq:
            return None
        err, ref = self.sq[name]
        return math.sqrt(err / ref) if ref > 0 else math.nan

    def stat(self, name: str, how: str = "mean") -> float | None:
        if name not in self.values:
            return None
        x = torch.cat(self.values[name])
        x = x[~torch.isnan(x)]
        if x.numel() == 0:
            return math.nan
        return float({"mean": x.mean, "median": x.median, "max": x.max}[how]())


def measure_layer(stats: LayerStats, layer: int, exact: ExactParts, model_out: torch.Tensor, last: torch.Tensor,
                  releases: dict, plans: Plans, conds: Sequence[Condition]) -> None:
    """Add one scenario's public queries (``exact.q``, with the model's own attention output
    ``model_out: [H_q, m, d]``; ``last: [m]`` marks each question's last query) of layer ``layer``
    to ``stats``: sinks, the DP part per span (mapping, kernel, noise), merged output per condition."""
    q, h = exact.q, exact.head
    full = exact.full()
    stats.add_sq("capture", rel_sq(model_out, full.out))
    # 1. sinks: a span's softmax mass is exp(lse_span - lse_all)
    pos0 = torch.exp(exact.span(0, 1).lse - full.lse)
    stats.add("mass_pos0", pos0)
    stats.add("mass_head", torch.exp(exact.head_part.lse - full.lse) if h else torch.zeros_like(full.lse))
    stats.add("mass_private", torch.exp(exact.private(h).lse - full.lse))
    stats.add("mass_tail", torch.exp(exact.tail.lse - full.lse))
    stats.add("last_pos0", pos0[:, last])
    # 2./3. the DP part per span against exact attention over the same rows
    dp_parts = {key: dp_part(dp, q) for key, dp in releases.items()}
    kv = _kv_index(q.shape[0], exact.ctx_k.shape[0])
    for public, span in ((False, "bare"), (True, "head")):
        start = h if public else 0
        private = exact.private(start)
        for eps in (None, *plans.eps):
            part = dp_parts[(public, eps)]
            tag = f"{span}_{'kernel' if eps is None else f'eps{eps:g}'}"
            stats.add_sq(f"dp_out_{tag}", rel_sq(part.out, private.out))
            stats.add(f"dp_lse_{tag}", (part.lse - private.lse).abs())
        dp = releases[(public, None)]
        mapped = dp.mapping.queries(q, torch.float64)
        log_scale = dp.mapping.log_scale(mapped, kv).to(torch.float64)
        keys, values = dp.mapping.keys(exact.ctx_k[:, start:]), dp.mapping.values(exact.ctx_v[:, start:])
        mapping = keys_part(mapped, keys, values, dp.mapping.beta)
        stats.add_sq(f"dp_out_{span}_mapping", rel_sq(mapping.out, private.out))
        stats.add(f"dp_lse_{span}_mapping", (mapping.lse + log_scale - private.lse).abs())
        stats.add(f"logit_max_{span}", keys_logits(mapped, keys, dp.mapping.beta).abs().amax(-1))
        feature_norm = dp.features(mapped).norm(dim=-1)  # ||P(q)||: the denominator noise's std per sigma
        den = torch.exp(private.lse - log_scale)  # the true denominator in the release's (centred) scale
        for eps in plans.eps:
            sigma = math.sqrt(plans.plan(public, eps).mechanisms[layer].variance)
            stats.add(f"noise_ratio_{span}_eps{eps:g}", sigma * feature_norm / den)
    # 4. the merged output per condition against exact full attention
    for cond in conds:
        parts = condition_parts(cond, exact, dp_parts)
        merged = merge_parts(*parts)
        stats.add_sq(f"merged_{cond.name}", rel_sq(merged.out, full.out))
        if cond.dp is not None:  # the softmax weight the merge gives the private part
            stats.add(f"private_weight_{cond.name}", torch.exp(parts[-1].lse - merged.lse))


# =========================================================================== one scenario
@dataclass
class Sequences:
    """One scenario as token ids: the context (``head`` public leading ids) and each question's
    user turn (with its answers, for scoring)."""

    name: str
    context: list[int]
    head: int
    questions: list[dict]  # {"ids": [...], "answers": [...], "kind": str, "q": str}


def run_scenario(model, seqs: Sequences, plans: Plans, conds: Sequence[Condition], layer_stats: list[LayerStats],
                 answer_tokens: int, answers: bool, seed: int, eos: int | None, log=print) -> dict:
    """Every measurement of one scenario (``layer_stats`` gets its per-layer numbers); returns its
    end-to-end rows (per condition and question) and the context's length."""
    P, h = len(seqs.context), seqs.head
    started = time.perf_counter()
    capture = Captured()
    with torch.no_grad(), Hooked(capture):
        prefill = model(input_ids=torch.tensor([seqs.context]), use_cache=True, logits_to_keep=1)
    prefix, beta = prefill.past_key_values, capture.scale
    layers = sorted(capture.k)
    ctx_k, ctx_v = capture.k, capture.v
    releases = {i: build_releases(plans, i, ctx_k[i], ctx_v[i], h, seed) for i in layers}
    log(f"  {seqs.name}: P={P} (public head {h}), {len(layers)} layers x {len(plans.releases())} releases built "
        f"({time.perf_counter() - started:.0f} s)")
    # the exact model on each question: its public queries (captured) and its greedy answer
    q_rows: dict[int, list] = {i: [] for i in layers}
    tails: dict[int, list] = {i: [] for i in layers}
    outs: dict[int, list] = {i: [] for i in layers}
    owner, positions, e2e = [], [], []
    for qi, question in enumerate(seqs.questions):
        ids = question["ids"]
        capture = Captured()
        cache = batched(prefix, 1)
        logits, cache = forward(model, torch.tensor([ids]), cache, capture)
        for i in layers:
            q_rows[i].append(capture.q[i])
            tails[i].append((capture.k[i][:, P:], capture.v[i][:, P:]))
            outs[i].append(capture.out[i])
        owner += [qi] * len(ids)
        positions.append(torch.arange(P, P + len(ids)))
        reference = greedy(model, cache, logits[:, -1], answer_tokens, None, eos)[0]
        # every condition at once (one batch row each; row 0 the exact model), teacher-forced
        rows = [None, *conds]
        hook = Replace(rows, P, h, releases)
        forced = torch.tensor([ids + reference[:-1]] * len(rows))
        logits, cache = forward(model, forced, batched(prefix, len(rows)), hook, keep=len(reference))
        logp = torch.log_softmax(logits, dim=-1)  # [B, answer, vocab]: the predictions of the answer's tokens
        target = torch.tensor(reference)
        texts = None
        if answers:  # each condition's own greedy answer, from its first prediction on
            if len(reference) > 1:
                cache.crop(1 - len(reference))  # back to context + user turn
            texts = greedy(model, cache, logits[:, 0], answer_tokens, hook, eos)
        for b, cond in enumerate(rows):
            hits = logp[b].argmax(-1) == target
            row = {"condition": "full" if cond is None else cond.name, "question": qi,
                   "agreement": float(hits.double().mean()), "first_token": bool(hits[0]),
                   "kl": float((logp[0].exp() * (logp[0] - logp[b])).sum(-1).mean()),
                   "scenario": seqs.name, "kind": question["kind"], "q": question["q"], "answers": question["answers"]}
            if cond is None:
                row["answer"] = reference
            elif texts is not None:
                row["answer"] = texts[b]
            e2e.append(row)
    # the per-layer measures: every question's public queries at once
    owner_t, pos = torch.tensor(owner), torch.cat(positions)
    allowed = (owner_t[:, None] == owner_t[None, :]) & causal_tail(pos, pos)
    last = torch.cat([owner_t[1:] != owner_t[:-1], torch.tensor([True])])
    for i in layers:
        tail_k = torch.cat([t[0] for t in tails[i]], dim=1)
        tail_v = torch.cat([t[1] for t in tails[i]], dim=1)
        exact = ExactParts(torch.cat(q_rows[i], dim=1), ctx_k[i], ctx_v[i], tail_k, tail_v, allowed, h, beta)
        measure_layer(layer_stats[i], i, exact, torch.cat(outs[i], dim=1), last, releases[i], plans, conds)
    log(f"  {seqs.name}: {len(seqs.questions)} questions measured ({time.perf_counter() - started:.0f} s)")
    return {"scenario": seqs.name, "context_tokens": P, "public_head": h, "rows": e2e}


# =========================================================================== summaries
SINKS = (("mass_pos0", "position 0"), ("mass_head", "public head [0, h)"),
         ("mass_private", "private rest [h, P)"), ("mass_tail", "public tail [P, p]"),
         ("last_pos0", "last query: position 0"))


def layer_rows(layer_stats: Sequence[LayerStats], plans: Plans, conds: Sequence[Condition]) -> list[dict]:
    """One JSON row per layer: the plan's public numbers and every measurement."""
    rows = []
    head_plan = plans.plan(True, None)
    report = head_plan.report()
    for i, s in enumerate(layer_stats):
        row = {"layer": i, "logit_bound": report["logit_bound"][i], "taylor_degree": report["taylor_degree"][i],
               "kernel_error_bound": report["kernel_error"][i],
               "noise_std": {f"{e:g}": math.sqrt(plans.plan(True, e).mechanisms[i].variance) for e in plans.eps},
               "capture_rel_error": s.rel("capture")}
        row["sinks"] = {key: s.stat(key) for key, _ in SINKS}
        for span in ("bare", "head"):
            row[span] = {
                "logit_max_observed": s.stat(f"logit_max_{span}", "max"),
                "out_rel_error": {t: s.rel(f"dp_out_{span}_{t}")
                                  for t in ("mapping", "kernel", *(f"eps{e:g}" for e in plans.eps))},
                "lse_abs_error_median": {t: s.stat(f"dp_lse_{span}_{t}", "median")
                                         for t in ("mapping", "kernel", *(f"eps{e:g}" for e in plans.eps))},
                "noise_to_denominator_median": {f"{e:g}": s.stat(f"noise_ratio_{span}_eps{e:g}", "median")
                                                for e in plans.eps},
            }
        row["merged_rel_error"] = {c.name: s.rel(f"merged_{c.name}") for c in conds}
        row["private_weight_mean"] = {c.name: s.stat(f"private_weight_{c.name}") for c in conds
                                      if c.dp is not None}
        rows.append(row)
    return rows


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None and not math.isnan(v)]
    return sum(known) / len(known) if known else None


def _median(values: Sequence[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None and not math.isnan(v))
    return known[len(known) // 2] if known else None


def aggregate(rows: Sequence[dict], eps: Sequence[float], conds: Sequence[Condition]) -> dict:
    """Layer means (and medians) of the per-layer numbers."""
    def over(get):
        values = [get(r) for r in rows]
        return {"mean": _mean(values), "median": _median(values), "max": max((v for v in values if v is not None),
                                                                             default=None)}

    out = {"sinks": {k: over(lambda r, k=k: r["sinks"][k]) for k, _ in SINKS},
           "capture_rel_error": over(lambda r: r["capture_rel_error"])}
    for span in ("bare", "head"):
        kinds = ("mapping", "kernel", *(f"eps{e:g}" for e in eps))
        out[span] = {
            "out_rel_error": {t: over(lambda r, t=t, s=span: r[s]["out_rel_error"][t]) for t in kinds},
            "lse_abs_error_median": {t: over(lambda r, t=t, s=span: r[s]["lse_abs_error_median"][t])
                                     for t in kinds},
            "noise_to_denominator_median": {f"{e:g}": over(lambda r, e=e, s=span: r[s]["noise_to_denominator_median"]
                                                           [f"{e:g}"]) for e in eps},
        }
    out["merged_rel_error"] = {c.name: over(lambda r, c=c: r["merged_rel_error"][c.name]) for c in conds}
    out["private_weight_mean"] = {c.name: over(lambda r, c=c: r["private_weight_mean"][c.name]) for c in conds
                                  if c.dp is not None}
    return out


def end_to_end(rows: Sequence[dict], conds: Sequence[Condition], scorer=None) -> list[dict]:
    """Per condition: top-1 agreement with the exact greedy answer (teacher-forced; all tokens and
    the first), mean KL and, where its rows have answer texts, the share of questions answered
    correctly per kind (``scorer(text, answers)``)."""
    out = []
    for name in ["full", *(c.name for c in conds)]:
        mine = [r for r in rows if r["condition"] == name]
        if not mine:
            continue
        entry = {"condition": name, "agreement": _mean([r["agreement"] for r in mine]),
                 "first_token_agreement": _mean([float(r["first_token"]) for r in mine]),
                 "kl": _mean([r["kl"] for r in mine]), "questions": len(mine)}
        if scorer is not None and all("text" in r for r in mine):
            for kind in ("shared", "secret", "public"):
                of_kind = [r for r in mine if r["kind"] == kind]
                entry[f"{kind}_correct"] = (sum(scorer(r["text"], r["answers"]) for r in of_kind) / len(of_kind)
                                            if of_kind else None)
        out.append(entry)
    return out


# =========================================================================== report
COND_HELP = {
    "full": "the exact model (reference)",
    "exact": "exact private part merged with the exact public parts (sanity: ~0)",
    "kernel_bare": "DP part over [0, P), noise off (kernel + mapping alone, no public head)",
    "kernel_head": "DP part over [h, P), noise off, public head exact",
    "dropped": "public head + public tail only (a closed gate)",
}


def cond_help(name: str) -> str:
    if name in COND_HELP:
        return COND_HELP[name]
    eps, span = name[3:].split("_")
    where = "[h, P), public head exact" if span == "head" else "[0, P), no public head"
    return f"DP part over {where}, the plan's noise at eps {eps}"


def markdown(data: dict) -> str:
    eps = data["eps"]
    rows, agg = data["layers"], data["aggregate"]
    conds = data["conditions"]
    lines = [f"# vllm-dp bench attention-real ({data['device']}, {data['date']})", "",
             (f"Command: `{data['command']}`. Model `{data['model']}` (float32, eager attention), calibration "
              f"`{data['calibration']}`; scenarios `{data['scenarios']}`, the first {len(data['scenario_info'])} "
              f"({', '.join('{} P={}'.format(s['scenario'], s['context_tokens']) for s in data['scenario_info'])}), "
              f"{data['questions_per_scenario']} questions each. Context = the chat template's system turn holding "
              f"the documents (positions [0, P)); public queries = the user-turn tokens (positions >= P), measured "
              f"per layer with that layer's exact inputs; public head h = {data['public_head']} tokens "
              f"(`public_head: auto`). DP part: the plan's `DPCrossAttention` (calibrated mapping, Taylor degree, "
              f"clamps; mode state, delta {DELTA:g}, composition pld), noise off (`kernel`) or the plan's "
              "noise (`eps E`). Relative errors are Frobenius norms pooled over heads, queries and questions; "
              "|d lse| = |log den_dp - log den| (median over heads and queries; relative denominator error = "
              "exp(|d lse|) - 1); noise/den = sigma ||P(q)|| / true denominator (median). Wall "
              f"{data['wall_s']:.0f} s."), ""]
    lines += ["## Layer means", "",
              table(["measure", "mean over layers", "median", "max"],
                    [[f"sink mass: {label}", *_trio(agg["sinks"][k])] for k, label in SINKS]
                    + [[f"DP part out rel. error, {span}, {t}", *_trio(agg[span]["out_rel_error"][t])]
                       for span in ("bare", "head") for t in ("mapping", "kernel", *(f"eps{e:g}" for e in eps))]
                    + [[f"DP part median abs d lse, {span}, {t}", *_trio(agg[span]["lse_abs_error_median"][t])]
                       for span in ("bare", "head") for t in ("mapping", "kernel")]
                    + [[f"noise std / denominator (median), {span}, eps {e:g}",
                        *_trio(agg[span]["noise_to_denominator_median"][f"{e:g}"])]
                       for span in ("bare", "head") for e in eps]
                    + [[f"merged output rel. error, {c}", *_trio(agg["merged_rel_error"][c])] for c in conds]
                    + [["capture: model's attention output vs recomputed", *_trio(agg["capture_rel_error"])]]),
              ""]
    lines += ["## 1. Sinks: exact attention mass of the public queries", "",
              table(["layer", *(label for _, label in SINKS)],
                    [[r["layer"], *(r["sinks"][k] for k, _ in SINKS)] for r in rows]), ""]
    kinds = ("mapping", "kernel", *(f"eps{e:g}" for e in eps))
    lines += ["## 2./3. The DP part vs exact attention over the same private rows", "",
              ("T: the plan's public logit bound; s: its Taylor degree (capped by max_features); bound: the "
               "guaranteed kernel error at T; max |t|: the largest centred, clipped logit actually seen."), "",
              table(["layer", "T", "s", "bound", "max |t| bare", "max |t| head",
                     *(f"out err bare {t}" for t in kinds), *(f"out err head {t}" for t in kinds),
                     "|d lse| bare kernel", "|d lse| head kernel",
                     *(f"noise/den head eps {e:g}" for e in eps)],
                    [[r["layer"], r["logit_bound"], r["taylor_degree"], r["kernel_error_bound"],
                      r["bare"]["logit_max_observed"], r["head"]["logit_max_observed"],
                      *(r["bare"]["out_rel_error"][t] for t in kinds), *(r["head"]["out_rel_error"][t] for t in kinds),
                      r["bare"]["lse_abs_error_median"]["kernel"], r["head"]["lse_abs_error_median"]["kernel"],
                      *(r["head"]["noise_to_denominator_median"][f"{e:g}"] for e in eps)] for r in rows]), ""]
    lines += ["## 4. Merged attention output vs exact full attention (relative error)", "",
              "; ".join(f"`{c}`: {cond_help(c)}" for c in conds) + ".", "",
              table(["layer", *conds], [[r["layer"], *(r["merged_rel_error"][c] for c in conds)] for r in rows]), ""]
    e2e = data["end_to_end"]
    lines += ["## End to end: every layer at once", "",
              (f"Teacher-forced on the exact model's greedy answer ({data['answer_tokens']} tokens): top-1 "
               "agreement of each condition's next-token prediction with it and mean KL(exact || condition)"
               + "; correct: its own greedy answer contains an accepted answer (scored as `bench context` does; "
               + ("every condition" if data["answers"] else "`full` only, `--answers` for the others") + ")."), ""]
    kinds_correct = ("shared_correct", "secret_correct", "public_correct")
    lines += [table(["condition", "agreement", "first token", "KL", "questions", "shared correct",
                     "secret leaked", "public correct"],
                    [[r["condition"], r["agreement"], r["first_token_agreement"], r["kl"], r["questions"],
                      *(r.get(k, "") if r.get(k) is not None else "" for k in kinds_correct)] for r in e2e]), ""]
    if data.get("samples"):
        lines += ["Sample answers (first question of the first scenario):", ""]
        lines += [f"* `{s['condition']}`: {s['text']!r}" for s in data["samples"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def _trio(x: dict) -> list:
    return [x["mean"], x["median"], x["max"]]


def plot(data: dict, path: Path) -> Path:
    """Per layer: sink masses; the DP part's output error (mapping, kernel, noise; with head);
    the merged output error per condition."""
    plt = pyplot()
    rows = data["layers"]
    layers = [r["layer"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for key, label in SINKS[:4]:
        axes[0].plot(layers, [r["sinks"][key] for r in rows], marker=".", label=label)
    axes[0].set_title("exact attention mass of the public queries", fontsize=10)
    axes[0].set_ylim(0, 1)
    for span, ls in (("head", "-"), ("bare", ":")):
        for i, t in enumerate(("mapping", "kernel", *(f"eps{e:g}" for e in data["eps"]))):
            axes[1].plot(layers, [_pos(r[span]["out_rel_error"][t]) for r in rows], ls=ls, color=f"C{i}",
                         marker=".", label=f"{t}, {span}")
    axes[1].set_yscale("log")
    axes[1].set_title("DP part: output rel. error vs exact over its rows", fontsize=10)
    for i, c in enumerate(data["conditions"]):
        if c != "exact":  # ~1e-16: it would only stretch the axis
            axes[2].plot(layers, [_pos(r["merged_rel_error"][c]) for r in rows], marker=".", color=f"C{i}", label=c)
    axes[2].set_yscale("log")
    axes[2].set_title("merged attention output: rel. error vs exact (exact path: ~1e-16)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("layer")
        ax.legend(fontsize=7)
    fig.suptitle(f"vllm-dp bench attention-real: {Path(data['model']).name}, {data['device']}", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def _pos(x):
    return x if x is not None and x > 0 else float("nan")


# =========================================================================== CLI
def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from vllm_dp_plugin.benchmarks.lib.scenarios import (
        DEFAULT_CACHE,
        DEFAULT_MODEL,
        DEFAULT_SCENARIOS,
    )

    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"Hugging Face model directory (default {DEFAULT_MODEL})")
    parser.add_argument("--scenarios", type=Path, default=DEFAULT_SCENARIOS,
                        help="scenarios JSONL (default: bench context's bundled scenarios)")
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help=f"the first N scenarios (default {DEFAULT_LIMIT})")
    parser.add_argument("--questions", type=ints, default=None,
                        help="indices of the questions of each scenario to ask, comma-separated (default all; "
                             "bench context's order: shared facts of support 1, 3, 10, 20, the secret, 2 public)")
    parser.add_argument("--eps", type=floats, default=DEFAULT_EPS,
                        help=f"eps of the noisy conditions, comma-separated (default {','.join(map(str, DEFAULT_EPS))})")
    parser.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS,
                        help=f"greedy answer tokens (teacher forcing and --answers; default {ANSWER_TOKENS})")
    parser.add_argument("--answers", action="store_true",
                        help="also generate each condition's own greedy answers and score them")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="calibration file (default: bench context's cached one in --cache-dir, made when missing)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where bench context caches the calibration")
    parser.add_argument("--seed", type=int, default=0, help="noise seed")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 scenario, questions 3 and 5, eps 8, 4 answer tokens")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines")
    add_out_arg(parser)
    add_date_arg(parser)
    return parser


def build_parser(prog: str = "vllm-dp bench attention-real") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))


def scenario_sequences(layout, scenarios: Sequence[dict], questions: Sequence[int] | None) -> list[Sequences]:
    """Each scenario's ids (``bench context``'s ``ChatLayout``) and its public head (the serving
    rule ``public_head: auto``)."""
    from vllm_dp_plugin.serving.context import head_length, public_head_ids

    header = public_head_ids(layout.tokenizer)
    out = []
    for s in scenarios:
        ids = layout.context_ids(s["documents"])
        qs = [{"ids": layout.user_ids(s["documents"], q["q"]), "answers": q["answers"], "kind": q["kind"], "q": q["q"]}
              for i, q in enumerate(s["questions"]) if questions is None or i in questions]
        out.append(Sequences(s["id"], ids, head_length(ids, "auto", header, s["id"]), qs))
    return out


def run(model, seqs: Sequence[Sequences], plans_of: Callable[[Sequences], Plans], eps: Sequence[float],
        answer_tokens: int, answers: bool, seed: int, eos: int | None, decode=None, log=print) -> dict:
    """Measure every scenario of ``seqs`` with ``model`` (prepared: ``prepare``); the JSON-ready
    result without the run's description (``layers``, ``aggregate``, ``end_to_end``, ...)."""
    conds = conditions(eps)
    n_layers = model.config.num_hidden_layers
    stats = [LayerStats() for _ in range(n_layers)]
    info, e2e, plans = [], [], None
    for i, s in enumerate(seqs):
        plans = plans_of(s)
        result = run_scenario(model, s, plans, conds, stats, answer_tokens, answers, seed + i, eos, log)
        info.append({"scenario": result["scenario"], "context_tokens": result["context_tokens"],
                     "public_head": result["public_head"]})
        e2e += result["rows"]
    if decode is not None:
        for r in e2e:
            if "answer" in r:
                r["text"] = decode(r["answer"])
    rows = layer_rows(stats, plans, conds)
    from vllm_dp_plugin.benchmarks.lib.scenarios import is_correct

    samples = [{"condition": r["condition"], "text": r["text"]} for r in e2e
               if r["scenario"] == seqs[0].name and r["question"] == 0 and "text" in r]
    return {"eps": list(eps), "conditions": [c.name for c in conds], "layers": rows,
            "aggregate": aggregate(rows, eps, conds), "scenario_info": info,
            "end_to_end": end_to_end(e2e, conds, is_correct), "end_to_end_rows": e2e,
            "samples": samples, "public_head": min(s["public_head"] for s in info) if info else 0}


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed arguments (``add_cli_args``) or an argv list (``vllm-dp bench attention-real ...``)."""
    args, argv = parse(args, build_parser)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_dp_plugin.benchmarks.lib.scenarios import (
        ChatLayout,
        cached_calibration,
        ensure_model,
        load_scenarios,
    )

    log = logger(not args.no_progress)
    eps, limit, questions, answer_tokens = tuple(args.eps), args.limit, args.questions, args.answer_tokens
    if args.quick:
        eps, limit, questions, answer_tokens = (8.0,), 1, (3, 5), 4
    started = time.perf_counter()
    model_dir = ensure_model(args.model)
    scenarios = load_scenarios(args.scenarios)[:limit]
    calibration = str(args.calibration or cached_calibration(model_dir, args.cache_dir))
    layout = ChatLayout(AutoTokenizer.from_pretrained(model_dir))
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prepare(model)
    shape = ModelShape.from_pretrained(model_dir)
    seqs = scenario_sequences(layout, scenarios, questions)
    tokenizer = layout.tokenizer
    log(f"vllm-dp bench attention-real: {len(seqs)} scenarios, eps {', '.join(f'{e:g}' for e in eps)}")
    measured = run(model, seqs, lambda s: Plans.of(shape, len(s.context), s.head, eps, calibration=calibration), eps,
                   answer_tokens, args.answers, args.seed, tokenizer.eos_token_id,
                   lambda ids: tokenizer.decode(ids, skip_special_tokens=True), log)
    device, date = device_label("cpu"), today(args.date)
    data = {"model": model_dir, "device": device, "date": date,
            "command": command_line("vllm-dp bench attention-real", argv), "calibration": calibration,
            "scenarios": _shown(args.scenarios), "questions_per_scenario": len(seqs[0].questions),
            "answer_tokens": answer_tokens, "answers": args.answers, "seed": args.seed,
            "environment": environment("cpu", packages=("transformers",)), "platform": platform.platform(),
            **measured, "wall_s": time.perf_counter() - started}
    stem = args.out / f"attention-real-{device}-{date}"
    write_json(suffixed(stem, ".json"), data, indent=1)
    write_text(suffixed(stem, ".md"), markdown(data))
    plot(data, suffixed(stem, ".png"))
    log(summary(data))
    log(f"vllm-dp bench attention-real: wrote {suffixed(stem, '.md')} (.json, .png)")
    return 0


def summary(data: dict) -> str:
    """A few lines for the terminal: layer means of the key numbers and the end-to-end table."""
    agg = data["aggregate"]
    parts = [f"sink mass pos0 {fmt(agg['sinks']['mass_pos0']['mean'])}, head {fmt(agg['sinks']['mass_head']['mean'])}",
             "DP part out err (kernel) bare " + fmt(agg["bare"]["out_rel_error"]["kernel"]["mean"])
             + ", head " + fmt(agg["head"]["out_rel_error"]["kernel"]["mean"]),
             "merged err: " + ", ".join(f"{c} {fmt(v['mean'])}" for c, v in agg["merged_rel_error"].items())]
    e2e = ", ".join(f"{r['condition']} {fmt(r['agreement'])}" for r in data["end_to_end"])
    return "\n".join([*parts, f"teacher-forced agreement: {e2e}"])


def _shown(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
