"""The parts ``python -m benchmarks.attention_real`` compares per layer: the conditions, exact attention over
the private span and the public rows (``ExactParts``), and the plan's DP part (``Plans``, noisy or
``NoiselessAttention``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_dp_plugin.attention.core import DPCrossAttention
from vllm_dp_plugin.attention.merge import AttentionPart, merge_parts
from vllm_dp_plugin.config import AttentionPrivacyConfig
from vllm_dp_plugin.plan import ContextPlan, ModelShape, layer_mapping
from vllm_dp_plugin.privacy.mechanisms import Mechanism
from vllm_dp_plugin.privacy.noise import NoiseDistribution

DELTA = 1e-6
MAX_CURVE_EPS = 100.0  # pld accounting refuses larger eps (config.MAX_CURVE_EPSILON): basic beyond


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
