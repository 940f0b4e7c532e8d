"""``python -m benchmarks.attention_ladder``: can any bounded kernel over a real model's keys carry a
private context's facts? The noise-free ladder, offline.

SmolLM2 (transformers, float32) answers ``bench context``'s questions over a collection laid out
as served: ``C`` = the chat template's system turn holding the documents one per line, the
public head ``[0, h)`` (``<|im_start|>system\\n``), the private span ``[h, P)``, then the user
turn. Every row differs only in how the user turn's queries (question and answer tokens) weigh the
private span's keys, in every layer, with no noise anywhere:

- ``full``: exact attention over the causally encoded context;
- ``none``: no context at all (the user turn alone);
- ``dropped``: the span left out, head and tail exact (what a closed gate gives);
- ``block``: each document encoded independently (its rows attend to the head and to itself,
  global positions), the question attends to all exactly: the K/V a document-level release can
  be built from (one document moves only its own rows);
- ``uniform``: within the span, every key gets the span's mean logit (values exact): the
  degree-0 limit of any kernel, exact softmax over head and tail;
- ``clusteredM``: the bounded clustered kernel over the block-encoded span: per layer and KV head,
  k-means centroids (``M`` of them) of keys of public text (CPython's pydoc topics) encoded as
  documents at positions spread over the span, each private key replaced by its nearest centroid.
  Its release would be a per-centroid count and value sum (bounded: a document adds its rows to
  ``M`` cells), so noise-free it is exactly this row;
- ``taylor``: the served state's feature map noise-free and unclipped: exp(x) ~ e^c T_2(x - c)
  around the logit c of the public mean key (T_2(t) = 1 + t + t^2/2 > 0).

Also, per layer, over the question's queries in ``full``: the logit range over the span
(max - min), the same with position 0 and the head included, the largest distance from the
Taylor centre, and the softmax mass on the span and on position 0: where the calibration's
logit bounds (39-72 on SmolLM2) come from.

Collections: the bundled 24 scenarios (~21 documents) and generated ones of ``--sizes``
documents (facts stated by 10% and 50% of them, a one-document secret, public questions).
Nothing here imports vllm. Writes ``attention-ladder-<device>-<date>.{md,json}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import with_example
from benchmarks.lib.scenario_generator import make_scenario
from vllm_dp_plugin.benchmarks.lib.cli import (
    add_date_arg,
    add_out_arg,
    command_line,
    ints,
    names,
    parse,
    today,
)
from vllm_dp_plugin.benchmarks.lib.progress import Progress
from vllm_dp_plugin.benchmarks.lib.scenarios import (
    ChatLayout,
    is_correct,
    load_scenarios,
    resolve_model,
)

IMPL = "vllm_dp_ladder"
MODES = ("full", "none", "dropped", "block", "uniform", "clustered64", "clustered256", "taylor")
CAUSAL_MODES = ("full", "dropped", "uniform", "taylor")  # read the causally encoded context
CALIBRATION_CHUNK = 128  # public tokens per calibration document
CALIBRATION_DOCS = 64  # -> 8,192 public keys per (layer, KV head)
KMEANS_ITERS = 15


# =========================================================================== attention
@dataclass
class Phase:
    """What the registered attention does now. ``kind``: ``causal`` (plain causal attention,
    any query offset), ``block`` (a prefill of the whole context, documents independent:
    ``segments`` are their ``[s, e)``), ``query`` (user-turn queries; ``mode`` rewrites the span's
    logits), ``capture`` (causal, keeping each layer's keys from ``head`` on)."""

    kind: str = "causal"
    head: int = 0
    span: tuple[int, int] = (0, 0)
    segments: Sequence[tuple[int, int]] = ()
    mode: str = "full"
    replaced: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> keys [H_kv, n, D]
    mean_key: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H_kv, D]
    stats: dict[int, list[dict]] | None = None  # layer -> per-call range statistics
    captured: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> [H_kv, n, D]


PHASE = Phase()


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``T`` positions of ``S``: ``q [B, Hq, T, D]``, ``k, v [B, Hkv, S, D]``."""
    t, s = q.shape[2], k.shape[2]
    if t == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, head: int,
           segments: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The context's prefill with independent documents: the head causally, each segment
    ``[s, e)`` over the head and itself."""
    out = torch.empty_like(q)
    out[:, :, :head] = _causal(q[:, :, :head], k[:, :, :head], v[:, :, :head], scale)
    for s, e in segments:
        keys, values = torch.cat([k[:, :, :head], k[:, :, s:e]], 2), torch.cat([v[:, :, :head], v[:, :, s:e]], 2)
        out[:, :, s:e] = _causal(q[:, :, s:e], keys, values, scale)
    return out


def _span_logits(phase: Phase, layer: int, q: torch.Tensor, k: torch.Tensor, logits: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """``logits [B, Hq, T, n]`` of the span rewritten by ``phase.mode``."""
    group = q.shape[1] // k.shape[1]
    mode = phase.mode
    if mode in ("full", "block"):
        return logits
    if mode == "dropped":
        return torch.full_like(logits, -math.inf)
    if mode == "uniform":
        return logits.mean(-1, keepdim=True).expand_as(logits)
    if mode == "taylor":
        centre = scale * q @ phase.mean_key[layer].repeat_interleave(group, 0)[None, :, :, None]  # [B, Hq, T, 1]
        t = logits - centre
        return centre + torch.log1p(t + t * t / 2)
    if mode.startswith("clustered"):
        keys = phase.replaced[layer].repeat_interleave(group, 0)[None]  # [1, Hq, n, D]
        return scale * q @ keys.transpose(-1, -2)
    raise ValueError(f"unknown mode {mode!r}")


def _query(phase: Phase, layer: int, q, k, v, scale: float) -> torch.Tensor:
    """User-turn queries (the last ``T`` of ``S`` positions) with the span's logits rewritten."""
    group = q.shape[1] // k.shape[1]
    t, s = q.shape[2], k.shape[2]
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = scale * q @ k_rep.transpose(-1, -2)  # [B, Hq, T, S]
    logits = logits.masked_fill(~torch.ones(t, s, dtype=torch.bool).tril(s - t), -math.inf)
    h, p = phase.span
    if phase.stats is not None and t > 1:
        phase.stats.setdefault(layer, []).append(_range_stats(phase, layer, q, logits, scale, group))
    logits[..., h:p] = _span_logits(phase, layer, q, k, logits[..., h:p], scale)
    return torch.softmax(logits, -1) @ v_rep


def _range_stats(phase: Phase, layer: int, q, logits, scale: float, group: int) -> dict:
    """Per query head, over the call's queries: the span's logit range, the range with position 0
    and the head, the largest distance from the Taylor centre, softmax mass on span and position 0."""
    h, p = phase.span
    span = logits[0, :, :, h:p]  # [Hq, T, n]
    context = logits[0, :, :, :p]
    centre = scale * q[0] @ phase.mean_key[layer].repeat_interleave(group, 0)[:, :, None]  # [Hq, T, 1]
    probs = torch.softmax(logits[0], -1)
    return {
        "span_range": (span.amax(-1) - span.amin(-1)).amax(-1).tolist(),
        "context_range": (context.amax(-1) - context.amin(-1)).amax(-1).tolist(),
        "taylor_distance": (span - centre).abs().amax((-1, -2)).tolist(),
        "span_mass": probs[:, :, h:p].sum(-1).mean(-1).tolist(),
        "sink_mass": probs[:, :, 0].mean(-1).tolist(),
    }


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    phase, layer, scale = PHASE, int(module.layer_idx), float(scaling)
    if phase.kind == "query":
        out = _query(phase, layer, query, key, value, scale)
    elif phase.kind == "block":
        out = _block(query, key, value, scale, phase.head, phase.segments)
    else:
        if phase.kind == "capture":
            phase.captured.setdefault(layer, []).append(key[0, :, phase.head:].clone())
        out = _causal(query, key, value, scale)
    return out.transpose(1, 2).contiguous(), None


def prepare(model) -> None:
    """Register ``IMPL`` (and no mask: ``_attention`` masks itself) and switch ``model`` to it."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(IMPL, _attention)
    AttentionMaskInterface.register(IMPL, lambda *args, **kwargs: None)
    model.set_attn_implementation(IMPL)
    model.eval()


# =========================================================================== collections
@dataclass
class Collection:
    """A collection's context ids, its head and private span, the documents' token segments."""

    name: str
    ids: list[int]
    head: int
    segments: list[tuple[int, int]]
    questions: list[dict]
    documents: list[str]

    @property
    def span(self) -> tuple[int, int]:
        return self.head, len(self.ids)


def collection(layout: ChatLayout, scenario: dict) -> Collection:
    """The scenario's context as served, split into head and documents by character offsets
    (a document's segment runs to the next document's start; the last one to the context's end)."""
    docs = scenario["documents"]
    text = layout.context_text(docs)
    enc = layout.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if ids != layout.context_ids(docs):
        raise ValueError(f"{scenario['id']}: offsets tokenization differs from the served context")
    starts, at = [], text.index(docs[0])
    for d in docs:
        at = text.index(d, at)
        starts.append(at)
        at += len(d)
    first = [next(i for i, (a, _) in enumerate(enc["offset_mapping"]) if a >= c) for c in starts]
    segments = list(zip(first, [*first[1:], len(ids)], strict=True))
    return Collection(scenario["id"], ids, first[0], segments, scenario["questions"], docs)


def large_scenarios(size: int, count: int, seed: int) -> list[dict]:
    """``count`` generated collections of ``size`` documents: facts stated by 10% and 50% of them."""
    rng = random.Random(seed)
    return [dict(make_scenario(rng, i, supports=(size // 10, size // 2), extra_docs=size - size // 2),
                 id=f"n{size}-{i}") for i in range(count)]


# =========================================================================== encoding
@torch.no_grad()
def encode(model, ids: Sequence[int], phase: Phase, positions: Sequence[int] | None = None):
    """A fresh cache holding ``ids`` encoded under ``phase``."""
    from transformers import DynamicCache

    global PHASE
    cache = DynamicCache(config=model.config)
    pos = torch.arange(len(ids)) if positions is None else torch.tensor(list(positions))
    PHASE = phase
    try:
        model.model(input_ids=torch.tensor([list(ids)]), position_ids=pos[None], past_key_values=cache, use_cache=True)
    finally:
        PHASE = Phase()
    return cache


def kmeans(x: torch.Tensor, m: int, generator: torch.Generator) -> torch.Tensor:
    """``m`` centroids of ``x: [N, D]`` (Lloyd, k-means++ start, ``KMEANS_ITERS`` rounds)."""
    picks = [int(torch.randint(len(x), (1,), generator=generator))]
    d2 = ((x - x[picks[0]]) ** 2).sum(1)
    for _ in range(m - 1):
        picks.append(int(torch.multinomial(d2 / d2.sum(), 1, generator=generator)))
        d2 = torch.minimum(d2, ((x - x[picks[-1]]) ** 2).sum(1))
    c = x[picks]
    for _ in range(KMEANS_ITERS):
        assign = torch.cdist(x, c).argmin(1)
        sums = torch.zeros_like(c).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=m).to(x.dtype)[:, None]
        c = torch.where(counts > 0, sums / counts.clamp(min=1), c)
    return c


@dataclass
class PublicKeys:
    """Per layer, keys of public text encoded as documents at the span's positions: their mean
    (the Taylor centre) and k-means centroids per KV head."""

    mean: dict[int, torch.Tensor]
    centroids: dict[int, dict[int, torch.Tensor]]  # m -> layer -> [H_kv, m, D]


def public_keys(model, tokenizer, head: Sequence[int], end: int, ms: Sequence[int], seed: int = 0) -> PublicKeys:
    """Public text encoded as documents after ``head`` at positions spread over ``[len(head), end)``."""
    from vllm_dp_plugin.demo import public_corpus

    text = "\n".join(public_corpus())
    pool = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    head, h, p = list(head), len(head), end
    phase = Phase(kind="capture", head=h)
    for i in range(CALIBRATION_DOCS):
        at = rng.randrange(len(pool) - CALIBRATION_CHUNK)
        offset = h + round(i * max(0, p - h - CALIBRATION_CHUNK) / max(1, CALIBRATION_DOCS - 1))
        encode(model, head + pool[at:at + CALIBRATION_CHUNK], phase,
               [*range(h), *range(offset, offset + CALIBRATION_CHUNK)])
    keys = {layer: torch.cat(chunks, 1) for layer, chunks in phase.captured.items()}  # [H_kv, N, D]
    gen = torch.Generator().manual_seed(seed)
    centroids = {m: {layer: torch.stack([kmeans(kh, m, gen) for kh in k]) for layer, k in keys.items()} for m in ms}
    return PublicKeys({layer: k.mean(1) for layer, k in keys.items()}, centroids)


def nearest(cache, centroids: dict[int, torch.Tensor], span: tuple[int, int]) -> dict[int, torch.Tensor]:
    """Per layer, the span's keys replaced by their nearest centroid: ``[H_kv, n, D]``."""
    h, p = span
    out = {}
    for layer, c in centroids.items():
        k = cache.layers[layer].keys[0, :, h:p]  # [H_kv, n, D]
        out[layer] = torch.stack([c[j][torch.cdist(k[j], c[j]).argmin(1)] for j in range(len(c))])
    return out


# =========================================================================== answering
@torch.no_grad()
def answer(model, cache, prompt: Sequence[int], phase: Phase, max_tokens: int, stop: set[int]) -> list[int]:
    """Greedy ``max_tokens`` after ``prompt`` (placed after the cache's positions); a ``query``
    phase's cache is cropped back to the context afterwards."""
    global PHASE
    start = cache.get_seq_length()
    ids, out = list(prompt), []
    PHASE = phase
    try:
        while len(out) < max_tokens:
            pos = torch.arange(start, start + len(ids))[None]
            logits = model(input_ids=torch.tensor([ids]), position_ids=pos, past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits[0, -1]
            token = int(logits.argmax())
            if token in stop:
                break
            out.append(token)
            start, ids = start + len(ids), [token]
    finally:
        PHASE = Phase()
        extra = cache.get_seq_length() - phase.span[1]
        if phase.kind == "query" and extra > 0:
            cache.crop(-extra)
    return out


def _centroids(mode: str) -> int:
    """M of ``clusteredM``; 0 for the other modes."""
    return int(mode.removeprefix("clustered")) if mode.startswith("clustered") else 0


def run_collection(model, layout: ChatLayout, coll: Collection, modes: Sequence[str], max_tokens: int,
                   stats: dict, publics: dict, log=print) -> list[dict]:
    """Every question of ``coll`` under every mode; ``stats`` collects ``full``'s logit ranges,
    ``publics`` caches the public keys per span length class (512 tokens: the calibration's
    positions are spread over the span, so collections of about one length share them)."""
    from transformers import DynamicCache

    tok = layout.tokenizer
    stop = {tok.eos_token_id, *tok.convert_tokens_to_ids(["<|im_end|>"])} - {None}
    span = coll.span
    t0 = time.perf_counter()
    causal = encode(model, coll.ids, Phase()) if set(modes) & set(CAUSAL_MODES) else None
    block = encode(model, coll.ids, Phase(kind="block", head=span[0], segments=coll.segments)) \
        if any(m == "block" or m.startswith("clustered") for m in modes) else None
    ms = sorted({_centroids(m) for m in modes} - {0})
    klass = (span[0], -(-span[1] // 512) * 512)
    if klass not in publics:
        publics[klass] = public_keys(model, tok, coll.ids[:span[0]], klass[1], ms)
    public = publics[klass]
    replaced = {m: nearest(block, public.centroids[m], span) for m in ms}
    log(f"  {coll.name}: {len(coll.documents)} documents, {len(coll.ids)} context tokens, "
        f"encoded in {time.perf_counter() - t0:.0f} s")
    rows = []
    for q in coll.questions:
        user = layout.user_ids(coll.documents, q["q"])
        for mode in modes:
            t1 = time.perf_counter()
            if mode == "none":
                ids = answer(model, DynamicCache(config=model.config), layout.none_ids(coll.documents, q["q"]),
                             Phase(), max_tokens, stop)
            else:
                cache = causal if mode in CAUSAL_MODES else block
                phase = Phase(kind="query", head=span[0], span=span, mode=mode, mean_key=public.mean,
                              replaced=replaced.get(_centroids(mode), {}),
                              stats=stats.setdefault(coll.name, {}) if mode == "full" else None)
                ids = answer(model, cache, user, phase, max_tokens, stop)
            text = tok.decode(ids, skip_special_tokens=True)
            rows.append({"collection": coll.name, "documents": len(coll.documents), "mode": mode, "q": q["q"],
                         "kind": q["kind"], "support": q["support"], "answer": text,
                         "correct": is_correct(text, q["answers"]), "seconds": time.perf_counter() - t1})
    return rows


# =========================================================================== summary and report
def summarize(rows: Sequence[dict]) -> list[dict]:
    """Per (collection size class, mode): accuracy per support, secret leak rate, public accuracy."""
    out = []
    for size in sorted({r["size"] for r in rows}, key=str):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            rs = [r for r in rows if r["size"] == size and r["mode"] == mode]
            if not rs:
                continue
            entry = {"size": size, "mode": mode, "questions": len(rs), "shared": {}}
            for support in sorted({r["support"] for r in rs if r["kind"] == "shared"}):
                hits = [r["correct"] for r in rs if r["kind"] == "shared" and r["support"] == support]
                entry["shared"][str(support)] = float(np.mean(hits))
            for kind, key in (("secret", "secret_leak_rate"), ("public", "public_accuracy")):
                hits = [r["correct"] for r in rs if r["kind"] == kind]
                entry[key] = float(np.mean(hits)) if hits else None
            entry["seconds_per_answer"] = float(np.mean([r["seconds"] for r in rs]))
            out.append(entry)
    return out


def range_table(stats: dict) -> list[dict]:
    """Per layer, over every question of every collection (``full``): medians of the per-call
    maxima over query heads, and the mean masses."""
    layers = sorted({layer for per in stats.values() for layer in per})
    out = []
    for layer in layers:
        calls = [c for per in stats.values() for c in per.get(layer, [])]
        out.append({"layer": layer,
                    "span_range": float(np.median([max(c["span_range"]) for c in calls])),
                    "context_range": float(np.median([max(c["context_range"]) for c in calls])),
                    "taylor_distance": float(np.median([max(c["taylor_distance"]) for c in calls])),
                    "span_mass": float(np.mean([np.mean(c["span_mass"]) for c in calls])),
                    "sink_mass": float(np.mean([np.mean(c["sink_mass"]) for c in calls]))})
    return out


def markdown(data: dict) -> str:
    lines = [f"# python -m benchmarks.attention_ladder ({data['device']}, {data['date']})", "",
             (f"Command: `{data['command']}`. Model: `{data['model']}`. Greedy, {data['max_tokens']} tokens, "
             "float32, no noise anywhere; an answer is correct when one of its answers occurs in it. "
             "Rows: see the module docstring (`benchmarks/attention_ladder.py`)."), ""]
    for size in dict.fromkeys(s["size"] for s in data["summary"]):
        rows = [s for s in data["summary"] if s["size"] == size]
        supports = sorted({k for s in rows for k in s["shared"]}, key=float)
        lines += [f"## {size}", "",
                  "| row | " + " | ".join(f"shared, support {k}" for k in supports)
                  + " | secret leak rate | public accuracy | s / answer | questions |",
                  "|---" * (len(supports) + 5) + "|"]
        for s in rows:
            cells = [f"{s['shared'].get(k, float('nan')):.2f}" for k in supports]
            pct = ["-" if s[k] is None else f"{s[k]:.2f}" for k in ("secret_leak_rate", "public_accuracy")]
            lines.append(f"| {s['mode']} | " + " | ".join(cells + pct)
                         + f" | {s['seconds_per_answer']:.2f} | {s['questions']} |")
        lines.append("")
    if data["ranges"]:
        lines += ["## Logit ranges of the user turn's queries (`full`, per layer)", "",
                  ("Per call (a question's prefill), the maximum over query heads and queries; the median over "
                  "calls. span: the private span [h, P) only; context: [0, P) (position 0 and the head "
                  "included); Taylor: max |logit - logit of the public mean key| over the span; masses: mean "
                  "softmax mass of a query on the span and on position 0."), "",
                  "| layer | span range | context range | Taylor distance | mass on span | mass on position 0 |",
                  "|---|---|---|---|---|---|"]
        for r in data["ranges"]:
            lines.append(f"| {r['layer']} | {r['span_range']:.1f} | {r['context_range']:.1f} | "
                         f"{r['taylor_distance']:.1f} | {r['span_mass']:.2f} | {r['sink_mass']:.2f} |")
        lines.append("")
    lines += ["## Sample answers", ""]
    for r in data["samples"]:
        lines.append(f"- {r['collection']} [{r['mode']}] {r['q']} -> {r['answer']!r} "
                     f"({'correct' if r['correct'] else 'wrong'})")
    return "\n".join(lines) + "\n"


# =========================================================================== CLI
def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default="smollm2", help="smollm2 (default) or a Hugging Face directory")
    parser.add_argument("--modes", type=names, default=MODES, help=f"rows (default {','.join(MODES)})")
    parser.add_argument("--limit", type=int, default=24, help="bundled scenarios to run (default all 24; 0: none)")
    parser.add_argument("--sizes", type=ints, default=(200, 1000),
                        help="documents per generated collection (default 200,1000; empty: none)")
    parser.add_argument("--collections", type=int, default=2, help="generated collections per size (default 2)")
    parser.add_argument("--seed", type=int, default=101, help="generator seed of the large collections")
    parser.add_argument("--max-tokens", type=int, default=24, help="answer tokens (default 24)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    add_out_arg(parser)
    add_date_arg(parser)
    return parser


@with_example
def build_parser(prog: str = "python -m benchmarks.attention_ladder") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from benchmarks.lib.models import load_causal_lm
    from vllm_dp_plugin.benchmarks.lib.scenarios import DEFAULT_SCENARIOS

    args, argv = parse(args, build_parser)
    unknown = set(args.modes) - set(MODES) - {f"clustered{m}" for m in range(1, 4097)}
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; known: {', '.join(MODES)} (clusteredM for any M)")
    name, directory = resolve_model(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_causal_lm(directory, dtype=torch.float32)
    prepare(model)
    layout = ChatLayout(AutoTokenizer.from_pretrained(directory))
    work = [("bundled", s) for s in load_scenarios(DEFAULT_SCENARIOS)[:args.limit]]
    work += [(f"{n} documents", s) for n in args.sizes for s in large_scenarios(n, args.collections, args.seed)]
    rows, stats, publics = [], {}, {}
    device = f"cpu-{platform.machine()}" if args.threads == 0 else f"cpu-{args.threads}thread"
    stem = args.out / f"attention-ladder-{device}-{today(args.date)}"
    args.out.mkdir(parents=True, exist_ok=True)
    progress = Progress(True).bar(len(work), "collections")
    for size, scenario in work:
        for r in run_collection(model, layout, collection(layout, scenario), args.modes, args.max_tokens, stats,
                                publics, log=progress.write):
            rows.append({**r, "size": size})
        progress.update(1)
        data = {"model": name, "device": device, "date": today(args.date), "platform": platform.platform(),
                "command": command_line("python -m benchmarks.attention_ladder", argv), "max_tokens": args.max_tokens,
                "summary": summarize(rows), "ranges": range_table(stats), "rows": rows,
                "samples": [r for r in rows if r["kind"] != "public"][:: max(1, len(rows) // 40)]}
        stem.with_suffix(".json").write_text(json.dumps(data, indent=1))  # after every collection
        stem.with_suffix(".md").write_text(markdown(data))
    progress.close()
    print(markdown(data))
    print(f"wrote {stem}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
