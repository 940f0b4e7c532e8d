"""The measures of ``python -m benchmarks.attention_real``: per layer (``LayerStats``, ``measure_layer``) and
end to end for one scenario (``run_scenario``)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from benchmarks.attention_real.capture import (
    Captured,
    Hooked,
    Replace,
    batched,
    forward,
    greedy,
)
from benchmarks.attention_real.parts import (
    Condition,
    ExactParts,
    Plans,
    _kv_index,
    build_releases,
    causal_tail,
    condition_parts,
    dp_part,
    keys_logits,
    keys_part,
    rel_sq,
)
from vllm_dp_plugin.attention.merge import merge_parts


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
