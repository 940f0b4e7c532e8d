"""The measurements of ``python -m benchmarks.attention``: exact references, error sources E0..E4,
accuracy on synthetic in-regime data, the noise-scaling probe, speed and memory.

Timing and peak memory come from ``benchmarks.lib.measure`` (``PeakMemory``: the CUDA
allocator's peak, or on CPU the kernel's resident-set high-water mark above the start).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.attention.settings import (
    BUILD_CHUNK,
    EXACT_PASS,
    GIB,
    MODES,
    STATE_TARGET,
    Settings,
)
from benchmarks.lib.measure import PeakMemory, median_time, time_once
from vllm_dp_plugin.attention.core import DPCrossAttention
from vllm_dp_plugin.attention.mapping import HeadMapping
from vllm_dp_plugin.attention.params import DPAttentionParams
from vllm_dp_plugin.benchmarks.lib.progress import Progress


# --------------------------------------------------------------------------- helpers
def tree_release_class():
    """``TreeRelease`` or None when the tree mode is not importable (reported as skipped)."""
    try:
        from vllm_dp_plugin.attention.tree import TreeRelease
    except ImportError:
        return None
    return TreeRelease


def synthetic(n: int, d: int, m: int, seed: int, heads: int = 1, dv: int | None = None):
    """In-regime data: K, Q ~ U[0,1]^d; V = clip(mu + 0.5 U[-1,1]^dv, -1, 1), mu ~ U[-1,1]^dv per head."""
    dv = dv or d
    g = torch.Generator().manual_seed(seed)
    k = torch.rand(heads, n, d, generator=g, dtype=torch.float64)
    q = torch.rand(heads, m, d, generator=g, dtype=torch.float64)
    mu = torch.rand(heads, 1, dv, generator=g, dtype=torch.float64) * 2 - 1
    v = (mu + 0.5 * (torch.rand(heads, n, dv, generator=g, dtype=torch.float64) * 2 - 1)).clamp(-1, 1)
    return k, q, v


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: float, dtype=torch.float64) -> torch.Tensor:
    """Exact softmax attention (torch SDPA, no mask) in ``dtype``: [H, m, d] x [H, n, d] -> [H, m, dv].

    Called in SDPA's standard 4-D layout [batch=1, H, L, d]: on CPU the 3-D form takes a slower
    path (2-4x at these sizes), so the 4-D one is the stronger baseline."""
    q, k, v = (x.to(dtype)[None] for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, scale=beta)[0]


def exact_lse(q: torch.Tensor, k: torch.Tensor, beta: float, chunk: int = 8192) -> torch.Tensor:
    """log sum_j exp(beta <q_i, k_j>): [H, m], float64, chunked over keys."""
    parts = [torch.logsumexp(beta * q @ k[:, i : i + chunk].transpose(1, 2), -1) for i in range(0, k.shape[1], chunk)]
    return torch.logsumexp(torch.stack(parts), 0)


def kernel_state(features, keys: torch.Tensor, values: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """Exact (noise-free) ``P(K)^T [V | 1]``: [H, F, dv + 1] float64 on mapped keys/values."""
    ones = torch.ones_like(values[..., :1])
    weights = torch.cat([values, ones], -1)
    state = None
    for i in range(0, keys.shape[1], chunk):
        part = torch.bmm(features(keys[:, i : i + chunk]).transpose(1, 2), weights[:, i : i + chunk])
        state = part if state is None else state + part
    return state


def kernel_attention(features, queries: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E2: (output [H, m, dv], den [H, m]) of the noise-free kernelised state."""
    ans = torch.bmm(features(queries), state)
    return ans[..., :-1] / ans[..., -1:], ans[..., -1]


def zero_tree_noise(spec, heads: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """All-zero node noise in the canonical layout, as stride-0 views (no memory)."""
    W, Fdim = spec.sensitivity.shape[:2]
    N, C = spec.leaves, spec.copies
    zero = torch.zeros((), dtype=torch.float64, device=device)
    return zero.expand(heads, W, C, Fdim, 3, 2 * N), zero.expand(heads, W, C, 2 * N)


def zero_noise_tree(att: DPCrossAttention, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor):
    """E3: the tree mode's answer with every node noise set to 0 (own-leaf exclusion only).
    Returns (output [H, m, dv], den [H, m])."""
    TreeRelease = tree_release_class()
    n = keys.shape[1]
    pk = att.features(att.mapping.keys(keys))
    vals = att.mapping.values(values)
    weights = torch.cat([vals, torch.ones_like(vals[..., :1])], -1)
    spec = att.tree_spec(n)
    generator = make_generator(str(keys.device), 0)  # unused: every node noise is injected (zero)
    release = TreeRelease.build(pk, weights, spec, generator, noise=zero_tree_noise(spec, keys.shape[0], keys.device))
    del pk, weights
    ans = release.answer(att.features(att.mapping.queries(queries)))
    return ans[..., :-1] / ans[..., -1:], ans[..., -1]


def build_chunked(att: DPCrossAttention, k: torch.Tensor, v: torch.Tensor, generator, chunk: int = BUILD_CHUNK):
    """``add`` in chunks (chunked prefill) then ``finalize``: what a server does."""
    for i in range(0, k.shape[1], chunk):
        att.add(k[:, i : i + chunk], v[:, i : i + chunk])
    return att.finalize(generator)


def make_generator(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def pct(x: np.ndarray, p: float) -> float:
    x = np.asarray(x, dtype=np.float64).ravel()
    x = x[np.isfinite(x)] if np.isfinite(x).any() else x
    return float(np.percentile(x, p)) if x.size else math.nan


def row_rel(est: torch.Tensor, ref: torch.Tensor) -> np.ndarray:
    """Relative row error ||est_i - ref_i|| / ||ref_i|| per (head, query)."""
    num = (est - ref).norm(dim=-1)
    return (num / ref.norm(dim=-1).clamp_min(1e-300)).flatten().cpu().numpy()


def row_cos(est: torch.Tensor, ref: torch.Tensor) -> np.ndarray:
    return F.cosine_similarity(est, ref, dim=-1, eps=1e-300).flatten().cpu().numpy()


def entry_normalised(est: torch.Tensor, ref: torch.Tensor, absref: torch.Tensor) -> np.ndarray:
    """|est - ref|_ik / (D^{-1} A |V|)_ik, per entry (with signed V the kernel's relative error
    is relative to D^{-1} A |V|, not to |O|)."""
    return ((est - ref).abs() / absref.clamp_min(1e-300)).flatten().cpu().numpy()


def den_rel(den: torch.Tensor, lse: torch.Tensor) -> np.ndarray:
    """|den - D| / D with D = exp(lse) (the exact denominator on mapped inputs)."""
    return (den * torch.exp(-lse) - 1).abs().flatten().cpu().numpy()


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y vs log x (nan with < 2 usable points)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if y and y > 0 and math.isfinite(y)]
    if len(pts) < 2:
        return math.nan
    lx, ly = np.array(pts).T
    return float(np.polyfit(lx, ly, 1)[0])


def make_params(mode: str, eps: float, settings: Settings, **kw) -> DPAttentionParams:
    """Unclamped params (clamps are applied by ``clamp_answer`` after recording den <= 0)."""
    extra = {"kernel_error": 0.1}  # the recorded results' setting (the library default is 0.01)
    if mode == "tree":
        extra["degree"] = settings.tree_degree
    extra.update(kw)
    return DPAttentionParams(
        eps, settings.delta, mode=mode, clamp=False, memory_limit_bytes=max(settings.memory_cap, 1), **extra
    )


def clamp_answer(att: DPCrossAttention, num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """The served output: core's post-processing clamps (den into [n e^{t_min}, n e^T], outputs
    into [-R_w, R_w]), applied to an answer obtained with ``clamp=False`` so that the pre-clamp
    denominator could be inspected."""
    den, num = att._clamped(den, num)
    return num / den[..., None]


# --------------------------------------------------------------------------- 1. accuracy
@dataclass
class Truth:
    """Exact references of one (n, d) dataset, float64."""

    e0: torch.Tensor
    e1: torch.Tensor
    absref: torch.Tensor
    lse1: torch.Tensor


def truths(mapping: HeadMapping, k, q, v) -> Truth:
    e0 = sdpa(q, k, v, mapping.beta)
    km, qm, vm = mapping.keys(k), mapping.queries(q), mapping.values(v)
    e1 = sdpa(qm, km, vm, mapping.beta)
    return Truth(e0, e1, sdpa(qm, km, vm.abs(), mapping.beta), exact_lse(qm, km, mapping.beta))


def dp_answer(att: DPCrossAttention, q: torch.Tensor) -> dict:
    raw = att.query_parts(q)
    out = clamp_answer(att, raw.num, raw.den)
    return {"out": out, "den": raw.den, "raw": raw.num / raw.den[..., None]}


def run_accuracy(settings: Settings, progress: Progress, cache: dict) -> dict:
    dev = settings.device
    TreeRelease = tree_release_class()
    records, sources, notes = [], [], []
    plan = []
    for d in settings.ds:
        for n in settings.ns:
            for mode in MODES:
                if mode == "tree":
                    eps, seeds = settings.tree_plan.runs(d, n, settings.epsilons, settings.seeds)
                else:
                    eps, seeds = list(settings.epsilons), settings.seeds
                plan.append((d, n, mode, eps, seeds))
    bar = progress.bar(sum(len(e) * s + 1 for *_, e, s in plan), "accuracy")
    data = {}
    for d, n, mode, eps_list, seeds in plan:
        bar.set_postfix_str(f"{mode} d={d} n={n}")
        mapping = HeadMapping.paper(d)
        if (d, n) not in data:
            data.clear()
            k, q, v = (x.to(dev) for x in synthetic(n, d, settings.m, seed=1_000_003 * d + n))
            data[(d, n)] = (k, q, v, truths(mapping, k, q, v))
        k, q, v, truth = data[(d, n)]
        probe = DPCrossAttention(make_params(mode, 1.0, settings), mapping, 1, d, d)
        feats = probe.features
        src = {
            "mode": mode,
            "d": d,
            "n": n,
            "r": feats.dim,
            "degree": getattr(feats, "degree", None),
            "kernel_error_bound": probe.kernel_error,
            "logit_bound": probe.logit_bound,
            "clip_rel_median": pct(row_rel(truth.e1, truth.e0), 50),
        }
        km, qm, vm = mapping.keys(k), mapping.queries(q), mapping.values(v)
        state = kernel_state(feats, km, vm)
        e2, den2 = kernel_attention(feats, qm, state)
        del state
        src.update(
            kernel_rel_median=pct(row_rel(e2, truth.e1), 50),
            kernel_rel_p95=pct(row_rel(e2, truth.e1), 95),
            kernel_den_rel_median=pct(den_rel(den2, truth.lse1), 50),
            e2_total_rel_median=pct(row_rel(e2, truth.e0), 50),
        )
        e3, den3 = None, None
        status = "ok"
        if mode == "tree":
            need = probe.tree_table_bytes(n)
            src["table_gib"] = need / GIB
            if TreeRelease is None:
                status = "skipped: vllm_dp_plugin.attention.tree not importable"
            elif need > settings.memory_cap:
                status = f"n/a (needs {need / GIB:.2f} GiB > cap {settings.memory_cap_gib:g} GiB)"
            elif not eps_list:
                status = "skipped: time (see tree plan)"
            else:
                e3, den3 = zero_noise_tree(probe, k, v, q)
                src.update(
                    ownleaf_rel_median=pct(row_rel(e3, e2), 50),
                    ownleaf_rel_p95=pct(row_rel(e3, e2), 95),
                    e3_den_rel_median=pct(den_rel(den3, truth.lse1), 50),
                    e3_total_rel_median=pct(row_rel(e3, truth.e0), 50),
                )
        src["status"] = status
        sources.append(src)
        bar.update(1)
        if status != "ok":
            for eps in settings.epsilons:
                records.append({"mode": mode, "d": d, "n": n, "eps": eps, "status": status, "r": feats.dim})
            continue
        noise_ref, noise_name = (e3, "E3") if e3 is not None else (e2, "E2")
        den_ref = den3 if e3 is not None else den2
        for eps in settings.epsilons:
            if eps not in eps_list:
                records.append({"mode": mode, "d": d, "n": n, "eps": eps, "status": "skipped: time (see tree plan)", "r": feats.dim})
                continue
            acc = {key: [] for key in ("rel", "cos", "nerr", "den", "den_noise", "noise", "raw_noise", "nonpos")}
            per_seed, builds, peaks, spent = [], [], [], None
            for seed in range(seeds):
                att = DPCrossAttention(make_params(mode, eps, settings), mapping, 1, d, d)
                gen = make_generator(dev, 7919 * seed + 17)
                with PeakMemory(dev) as mem:
                    builds.append(time_once(partial(build_chunked, att, k, v, gen), dev))
                peaks.append(mem.peak)
                ans = dp_answer(att, q)
                out = ans["out"]
                rel = row_rel(out, truth.e0)
                acc["rel"].append(rel)
                acc["cos"].append(row_cos(out, truth.e0))
                acc["nerr"].append(entry_normalised(out, truth.e0, truth.absref))
                acc["den"].append(den_rel(ans["den"], truth.lse1))
                acc["den_noise"].append(((ans["den"] - den_ref).abs() * torch.exp(-truth.lse1)).flatten().cpu().numpy())
                acc["nonpos"].append((ans["den"] <= 0).flatten().cpu().numpy())
                acc["noise"].append(row_rel(out, noise_ref))
                acc["raw_noise"].append(row_rel(ans["raw"], noise_ref))
                per_seed.append(float(np.median(rel)))
                if spent is None:
                    spent = att.account.spent(1)
                if d == settings.speed_d and n in settings.speed_ns and seed == 0 and mode == "tree" and eps == eps_list[0]:
                    qs = median_time(partial(att.query, q), dev, settings.speed_min_time)
                    cache[("tree", n)] = {
                        "build_s": builds[-1], "peak_bytes": peaks[-1], "query_s": qs, "release_nbytes": att.release_nbytes
                    }
                release_nbytes = att.release_nbytes
                del att, ans, out
                bar.update(1)
            cat = {key: np.concatenate(val) for key, val in acc.items()}
            records.append(
                {
                    "mode": mode,
                    "d": d,
                    "n": n,
                    "eps": eps,
                    "status": "ok",
                    "seeds": seeds,
                    "r": feats.dim,
                    "degree": getattr(feats, "degree", None),
                    "rel_median": pct(cat["rel"], 50),
                    "rel_p95": pct(cat["rel"], 95),
                    "rel_median_seed_min": min(per_seed),
                    "rel_median_seed_max": max(per_seed),
                    "cos_median": pct(cat["cos"], 50),
                    "cos_p05": pct(cat["cos"], 5),
                    "nerr_median": pct(cat["nerr"], 50),
                    "nerr_p95": pct(cat["nerr"], 95),
                    "den_rel_median": pct(cat["den"], 50),
                    "den_rel_p95": pct(cat["den"], 95),
                    "den_noise_rel_median": pct(cat["den_noise"], 50),
                    "den_nonpos_frac": float(cat["nonpos"].mean()),
                    "noise_rel_median": pct(cat["noise"], 50),
                    "noise_rel_p95": pct(cat["noise"], 95),
                    "raw_noise_rel_median": pct(cat["raw_noise"], 50),
                    "noise_ref": noise_name,
                    "build_s": float(np.median(builds)),
                    "peak_build_bytes": int(max(peaks)),
                    "release_nbytes": int(release_nbytes),
                    "spent_epsilon": spent.epsilon,
                    "spent_delta": spent.delta,
                }
            )
        del e2, e3, den2, den3
    bar.close()
    data.clear()
    slopes = fit_slopes(records)
    target = next(
        (
            r
            for r in records
            if r["mode"] == "state" and r["d"] == STATE_TARGET["d"] and r["n"] == STATE_TARGET["n"]
            and r["eps"] == STATE_TARGET["eps"] and r["status"] == "ok"
        ),
        None,
    )
    if TreeRelease is None:
        notes.append("tree mode skipped: vllm_dp_plugin.attention.tree is not importable")
    return {"records": records, "sources": sources, "slopes": slopes, "target": target, "notes": notes}


def fit_slopes(records: list[dict]) -> list[dict]:
    out = []
    keys = sorted({(r["mode"], r["d"], r["eps"]) for r in records if r["status"] == "ok"})
    for mode, d, eps in keys:
        rows = sorted((r for r in records if (r["mode"], r["d"], r["eps"]) == (mode, d, eps) and r["status"] == "ok"), key=lambda r: r["n"])
        ns = [r["n"] for r in rows]
        out.append(
            {
                "mode": mode,
                "d": d,
                "eps": eps,
                "ns": ns,
                "noise_slope": fit_slope(ns, [r["noise_rel_median"] for r in rows]),
                "raw_noise_slope": fit_slope(ns, [r["raw_noise_rel_median"] for r in rows]),
                "den_slope": fit_slope(ns, [r["den_noise_rel_median"] for r in rows]),
                "total_slope": fit_slope(ns, [r["rel_median"] for r in rows]),
            }
        )
    return out


def run_probe(settings: Settings, progress: Progress) -> dict:
    """Noise scaling with many seeds at a tiny head dim, where tree builds are cheap.

    The tree's node noise enters every query through shared terms (P_wx, s_w, upper tree
    levels), so one seed is ~one draw for all m queries and slopes fitted on 1-seed medians are
    unreliable. Here: eps = 1, ``probe_seeds`` seeds per n, the denominator noise
    (D~ - D_ref) / D pooled over seeds and queries (RMS), D_ref = E2 (state) or E3 (tree)."""
    dev, d, m, eps = settings.device, settings.probe_d, settings.probe_m, 1.0
    TreeRelease = tree_release_class()
    mapping = HeadMapping.paper(d)
    modes = [m_ for m_ in MODES if m_ == "state" or (TreeRelease is not None and settings.tree_plan.kind != "none")]
    bar = progress.bar(len(modes) * len(settings.ns) * settings.probe_seeds, "noise probe")
    rows = []
    for mode in modes:
        for n in settings.ns:
            bar.set_postfix_str(f"{mode} d={d} n={n}")
            k, q, v = (x.to(dev) for x in synthetic(n, d, m, seed=7 * n + d))
            probe = DPCrossAttention(make_params(mode, eps, settings), mapping, 1, d, d)
            row = {"mode": mode, "d": d, "n": n, "m": m, "eps": eps, "seeds": settings.probe_seeds, "r": probe.features.dim}
            if mode == "tree" and probe.tree_table_bytes(n) > settings.memory_cap:
                row["status"] = f"n/a (needs {probe.tree_table_bytes(n) / GIB:.2f} GiB)"
                rows.append(row)
                bar.update(settings.probe_seeds)
                continue
            km, qm = mapping.keys(k), mapping.queries(q)
            lse = exact_lse(qm, km, mapping.beta)
            if mode == "tree":
                ref, den_ref = zero_noise_tree(probe, k, v, q)
            else:
                ref, den_ref = kernel_attention(probe.features, qm, kernel_state(probe.features, km, mapping.values(v)))
            den_noise, served = [], []
            for seed in range(settings.probe_seeds):
                att = DPCrossAttention(make_params(mode, eps, settings), mapping, 1, d, d)
                build_chunked(att, k, v, make_generator(dev, 104729 * seed + 1))
                ans = dp_answer(att, q)
                den_noise.append(((ans["den"] - den_ref) * torch.exp(-lse)).flatten().cpu().numpy())
                served.append(row_rel(ans["out"], ref))
                del att
                bar.update(1)
            noise = np.stack(den_noise)  # [seeds, m]
            corr = np.corrcoef(noise.T) if noise.shape[0] > 2 else np.full((m, m), np.nan)
            row.update(
                status="ok",
                den_noise_rms=float(np.sqrt(np.mean(noise**2))),
                den_noise_median_abs=pct(np.abs(noise), 50),
                served_noise_median=pct(np.concatenate(served), 50),
                query_correlation=float(np.nanmean(corr[np.triu_indices(m, 1)])),
            )
            rows.append(row)
    bar.close()
    slopes = []
    for mode in modes:
        ok = [r for r in rows if r["mode"] == mode and r["status"] == "ok"]
        slopes.append(
            {
                "mode": mode,
                "ns": [r["n"] for r in ok],
                "den_noise_slope": fit_slope([r["n"] for r in ok], [r["den_noise_rms"] for r in ok]),
                "served_noise_slope": fit_slope([r["n"] for r in ok], [r["served_noise_median"] for r in ok]),
            }
        )
    return {"rows": rows, "slopes": slopes, "d": d, "seeds": settings.probe_seeds, "m": m, "eps": eps}


# --------------------------------------------------------------------------- 3. speed
def run_speed(settings: Settings, progress: Progress, cache: dict) -> dict:
    dev, d, m = settings.device, settings.speed_d, settings.m
    TreeRelease = tree_release_class()
    mapping = HeadMapping.paper(d)
    rows = []
    bar = progress.bar(len(settings.speed_ns) * 3, "speed")
    for n in settings.speed_ns:
        k, q, v = (x.to(dev) for x in synthetic(n, d, m, seed=1_000_003 * d + n))
        row = {"n": n, "d": d, "m": m, "kv_bytes_fp32": int(2 * n * d * 4), "kv_bytes_fp16": int(2 * n * d * 2)}
        bar.set_postfix_str(f"exact n={n}")
        k32, q32, v32 = (x.float() for x in (k, q, v))
        row["exact_query_s"] = median_time(partial(sdpa, q32, k32, v32, mapping.beta, torch.float32), dev, settings.speed_min_time)
        row["exact_query_fp64_s"] = median_time(partial(sdpa, q, k, v, mapping.beta), dev, settings.speed_min_time)
        prefill = partial(sdpa, k32, k32, v32, mapping.beta, torch.float32)
        prefill()
        reps = 3 if n <= 4096 else 1
        row["exact_prefill_s"] = float(np.median([time_once(prefill, dev) for _ in range(reps)]))
        bar.update(1)

        bar.set_postfix_str(f"state n={n}")
        builds, peaks, att = [], [], None
        for rep in range(2 if n > 4096 else 3):
            att = DPCrossAttention(make_params("state", 1.0, settings), mapping, 1, d, d)
            gen = make_generator(dev, 31 + rep)
            with PeakMemory(dev) as mem:
                builds.append(time_once(partial(build_chunked, att, k, v, gen), dev))
            peaks.append(mem.peak)
        row["state_build_s"] = float(np.median(builds))
        row["state_peak_bytes"] = int(max(peaks))
        row["state_query_s"] = median_time(partial(att.query, q), dev, settings.speed_min_time)
        mapped = att.mapping.queries(q)
        features = partial(att.features, mapped)
        query_dtype = getattr(att.params, "query_dtype", None)  # the dtype att.query uses, if any
        if query_dtype is not None:
            features = partial(att.features, mapped, getattr(torch, query_dtype))
        row["state_features_s"] = median_time(features, dev, settings.speed_min_time)
        row["state_release_bytes"] = att.release_nbytes
        row["state_r"] = att.features.dim
        del att
        bar.update(1)

        bar.set_postfix_str(f"tree n={n}")
        probe = DPCrossAttention(make_params("tree", 1.0, settings), mapping, 1, d, d)
        row["tree_r"] = probe.features.dim
        need = probe.tree_table_bytes(n)
        if TreeRelease is None:
            row["tree_status"] = "skipped: tree not importable"
        elif settings.tree_plan.kind == "none":
            row["tree_status"] = "skipped: --tree-plan none"
        elif need > settings.memory_cap:
            row["tree_status"] = f"n/a (needs {need / GIB:.2f} GiB)"
        elif ("tree", n) in cache and dev == "cpu":  # on CUDA re-time after a warm-up build (JIT)
            row.update({f"tree_{key}": val for key, val in cache[("tree", n)].items()})
            row["tree_status"] = "ok (build timed in the accuracy part, same config)"
        else:
            if dev != "cpu":  # warm-up build: triton compiles its kernels on first use
                build_chunked(DPCrossAttention(make_params("tree", 1.0, settings), mapping, 1, d, d), k, v, make_generator(dev, 30))
            att = DPCrossAttention(make_params("tree", 1.0, settings), mapping, 1, d, d)
            gen = make_generator(dev, 31)
            with PeakMemory(dev) as mem:
                row["tree_build_s"] = time_once(partial(build_chunked, att, k, v, gen), dev)
            row["tree_peak_bytes"] = mem.peak
            row["tree_query_s"] = median_time(partial(att.query, q), dev, settings.speed_min_time)
            row["tree_release_nbytes"] = att.release_nbytes
            row["tree_status"] = "ok"
            del att
        bar.update(1)
        for mode in ("exact", "state", "tree"):
            key = f"{mode}_query_s"
            if key in row:
                row[f"{mode}_tokens_per_s"] = m / row[key]
        if "state_query_s" in row:
            row["state_speedup"] = row["exact_query_s"] / row["state_query_s"]
        if "tree_query_s" in row:
            row["tree_speedup"] = row["exact_query_s"] / row["tree_query_s"]
        row["state_build_over_prefill"] = row["state_build_s"] / row["exact_prefill_s"]
        if "tree_build_s" in row:
            row["tree_build_over_prefill"] = row["tree_build_s"] / row["exact_prefill_s"]
        rows.append(row)
    bar.close()
    return {"rows": rows, "definition": EXACT_PASS}


