"""The report of ``python -m benchmarks.attention``: targets, notes, markdown, CSV, plots, and reading
a saved results JSON back (``--render``)."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.attention.settings import (
    MODES,
    SPEED_TARGETS,
    STATE_TARGET,
    Settings,
    TreePlan,
)
from vllm_dp_plugin.benchmarks.lib.environment import device_label
from vllm_dp_plugin.benchmarks.lib.report import (
    fmt,
    pyplot,
    read_json,
    save_figure,
    suffixed,
    table,
    write_json,
    write_text,
)


# --------------------------------------------------------------------------- targets
def targets(results: dict) -> list[dict]:
    out = []
    acc = results.get("accuracy")
    t = STATE_TARGET
    label = f"state accuracy: n={t['n']}, d={t['d']}, eps={t['eps']:g} per head: median relative row error <= {t['max_median_rel']}"
    if acc and acc.get("target"):
        value = acc["target"]["rel_median"]
        out.append({"name": label, "value": value, "passed": bool(value <= t["max_median_rel"])})
    else:
        out.append({"name": label, "value": None, "passed": None})
    speed = {r["n"]: r for r in (results.get("speed") or {}).get("rows", [])}
    s = SPEED_TARGETS
    for n in s["state_ns"]:
        label = f"state query throughput >= {s['state_query_speedup']:g}x exact SDPA (fp32) at n={n}, d=64"
        row = speed.get(n)
        if row and "state_speedup" in row and row.get("d") == 64:
            out.append({"name": label, "value": row["state_speedup"],
                        "passed": bool(row["state_speedup"] >= s["state_query_speedup"])})
        else:
            out.append({"name": label, "value": None, "passed": None})
    label = f"tree build <= {s['tree_build_ratio']:g}x one exact attention pass at n={s['tree_n']}, d=64"
    row = speed.get(s["tree_n"])
    if row and "tree_build_over_prefill" in row and row.get("d") == 64:
        ratio = row["tree_build_over_prefill"]
        out.append({"name": label, "value": ratio, "passed": bool(ratio <= s["tree_build_ratio"])})
    else:
        out.append({"name": label, "value": None, "passed": None})
    return out


def target_line(t: dict) -> str:
    if t["passed"] is None:
        return f"n/a  {t['name']} (not measured in this run)"
    return f"{'PASS' if t['passed'] else 'FAIL'} {t['name']}: measured {fmt(t['value'], 4)}"


# --------------------------------------------------------------------------- markdown
def markdown(results: dict, settings: Settings, files: list[Path]) -> str:
    info = results["machine"]
    out = [f"# DP cross-attention benchmark: {info['device']} ({settings.date})", ""]
    desc = f"{info.get('cpu', '?')}, {info['cpu_count']} logical cores, {info.get('ram_gib', '?')} GiB RAM"
    if "gpu" in info:
        desc = f"{info['gpu']} ({info['gpu_memory_gib']} GiB, CUDA {info['cuda']}, triton {info['triton']}); host {desc}"
    out += [
        f"- Machine: {desc}; {info['platform']}",
        f"- Python {info['python']}, torch {info['torch']} ({info['torch_threads']} intra-op threads)",
        f"- Command: `{settings.command}`",
        f"- Wall time of this run: {results['runtime_s'] / 60:.1f} min",
        f"- Settings: n in {list(settings.ns)}, d in {list(settings.ds)}, eps per head in {list(settings.epsilons)}, "
        f"delta = {settings.delta:g}, m = {settings.m} queries, {settings.seeds} noise seeds, 1 KV head, "
        f"tree Taylor degree {settings.tree_degree}, tree memory cap {settings.memory_cap_gib:g} GiB"
        + (" (**--quick**: toy sizes, targets not measured)" if settings.quick else ""),
        f"- {settings.tree_plan.describe()}",
        "",
        "## Targets",
        "",
        "```",
        *[target_line(t) for t in results["targets"]],
        "```",
        "",
    ]
    acc = results.get("accuracy")
    if acc:
        out += _accuracy_md(acc, settings)
    real = results.get("real")
    if real:
        # imported here: `python -m ...attention.real_heads` runs the package's __init__ first
        from benchmarks.attention.real_heads import markdown_section

        out += markdown_section(real)
    speed = results.get("speed")
    if speed:
        out += _speed_md(speed, settings)
    out += ["## Files", ""] + [f"- `{p.name}`" for p in files] + [""]
    out += ["## Notes", ""] + [f"- {n}" for n in results["notes"]] + [""]
    return "\n".join(out)


def _accuracy_md(acc: dict, settings: Settings) -> list[str]:
    out = [
        "## 1. Accuracy, in-regime synthetic data",
        "",
        ("Paper setting (`HeadMapping.paper(d)`): beta = 1/d, K, Q ~ U[0,1]^d (so T = beta d R^2 = 1), "
        "V rows = clip(mu + 0.5 U[-1,1]^d, -1, 1) with one mu ~ U[-1,1]^d per head: outputs have a "
        "non-trivial norm (||O_i|| ~ ||mu||), so relative errors are not inflated by near-zero outputs. "
        "One KV head, (eps, delta) per head, noise drawn once per seed (data fixed per (n, d)). "
        "State: Taylor degree from the rule (kernel_error 0.1), Gaussian state release (sensitivity from the public bounds). "
        f"Tree: Taylor degree {settings.tree_degree}, l = 1 copy, tight c (the vectorised DPTree). "
        "Outputs are served with core's clamps (den into [n e^{t_min}, n e^T], outputs into [-R_w, R_w]); "
        "`den<=0` is the fraction of queries whose DP denominator was <= 0 *before* the clamp."),
        "",
        "Error sources (medians of the relative row error ||a_i - b_i|| / ||b_i|| over the m queries):",
        ("E1 vs E0 = clipping, E2 vs E1 = kernel (Taylor) error, E3 vs E2 = own-leaf bias of the tree "
        "(zero node noise), E4 vs E2/E3 = DP noise, E4 vs E0 = total."),
        "",
    ]
    rows = []
    for s in acc["sources"]:
        rows.append(
            [
                s["mode"], s["d"], s["n"], s["r"], s["degree"], s["kernel_error_bound"], s["clip_rel_median"],
                s["kernel_rel_median"], s["kernel_rel_p95"], s["kernel_den_rel_median"],
                s.get("ownleaf_rel_median", "n/a"), s.get("e3_den_rel_median", "n/a"), s["status"],
            ]
        )
    out += [
        table(
            ["mode", "d", "n", "r", "s", "eps_s bound", "E1vsE0 med", "E2vsE1 med", "E2vsE1 p95", "E2 den rel",
             "E3vsE2 med", "E3 den rel", "status"],
            rows,
        ),
        "",
        ("DP accuracy (E4 = served DP output). `rel` = relative row error vs E0; `nerr` = |O~ - O|_ik / "
        "(D^-1 A|V|)_ik; `noise` = E4 vs the noise-free reference (E3 for tree, E2 for state); "
        "`raw noise` = the same before the clamps; `den rel` = |D~ - D| / D before the clamp; seeds "
        "pooled (`seed range` = min..max of per-seed medians)."),
        "",
    ]
    rows = []
    for r in acc["records"]:
        if r["status"] != "ok":
            rows.append([r["mode"], r["d"], r["n"], r["eps"]] + [""] * 10 + [r["status"]])
            continue
        rows.append(
            [
                r["mode"], r["d"], r["n"], r["eps"], r["seeds"], r["rel_median"], r["rel_p95"],
                f"{fmt(r['rel_median_seed_min'])}..{fmt(r['rel_median_seed_max'])}", r["cos_median"],
                r["nerr_median"], r["noise_rel_median"], r["raw_noise_rel_median"], r["den_rel_median"],
                r["den_nonpos_frac"], f"ok (eps spent {fmt(r['spent_epsilon'])})",
            ]
        )
    out += [
        table(
            ["mode", "d", "n", "eps", "seeds", "rel med", "rel p95", "seed range", "cos med", "nerr med",
             "noise med", "raw noise med", "den rel med", "den<=0", "status"],
            rows,
        ),
        "",
        ("Slopes of log(error) vs log(n) (least squares over the n that ran; expect about -1 while the "
        "noise is below the signal: the noise is independent of n, the denominator grows like n). "
        "`noise` = served E4 vs E2/E3 (clamps flatten it once noise dominates), `raw noise` = before "
        "clamps, `den` = the denominator's noise |D~ - D_ref| / D (D_ref = E2's or E3's denominator, so "
        "the fixed kernel bias of the Taylor map does not flatten it)."),
        "",
        table(
            ["mode", "d", "eps", "n used", "noise slope", "raw noise slope", "den slope", "total slope"],
            [
                [s["mode"], s["d"], s["eps"], ",".join(str(n) for n in s["ns"]), s["noise_slope"],
                 s["raw_noise_slope"], s["den_slope"], s["total_slope"]]
                for s in acc["slopes"]
            ],
        ),
        "",
    ]
    probe = acc.get("probe")
    if probe:
        out += [
            (f"**Noise-scaling probe** (d = {probe['d']}, m = {probe['m']}, eps = {probe['eps']:g}, "
            f"{probe['seeds']} seeds per n, same modes and parameters): a release's noise is largely shared by "
            "all its queries (`query corr` = mean pairwise correlation of the denominator noise across seeds; "
            "similar query features, and for the tree the common P_wx, s_w and upper-level nodes), so the "
            "1-seed tree rows above are single draws; the RMS over many seeds gives the scaling. `den noise "
            "RMS` = RMS of (D~ - D_ref) / D over seeds and queries; `served noise` = median of E4 vs E2/E3."),
            "",
            table(
                ["mode", "n", "r", "seeds", "den noise RMS", "den noise med abs", "served noise med", "query corr", "status"],
                [
                    [r["mode"], r["n"], r["r"], r["seeds"], r.get("den_noise_rms", ""), r.get("den_noise_median_abs", ""),
                     r.get("served_noise_median", ""), r.get("query_correlation", ""), r["status"]]
                    for r in probe["rows"]
                ],
            ),
            "",
            table(
                ["mode", "n used", "den noise RMS slope", "served noise slope"],
                [[s["mode"], ",".join(str(n) for n in s["ns"]), s["den_noise_slope"], s["served_noise_slope"]]
                 for s in probe["slopes"]],
            ),
            "",
        ]
    return out


def _speed_md(speed: dict, settings: Settings) -> list[str]:
    rows = speed["rows"]
    out = [
        "## 3. Speed and memory",
        "",
        (f"1 KV head, d = {settings.speed_d}, m = {settings.m} query tokens, eps = 1, device {settings.device}. "
        f"Query time = median per call (2 warm-up calls, then >= 5 calls and >= {settings.speed_min_time:g} s, "
        "torch's thread count as is) of `att.query(Q)` (map + features + contraction in the query dtype of "
        "the params, float64 before `query_dtype` existed; "
        "`state feat ms` = the Taylor feature map of the m queries alone) vs SDPA of the m queries "
        "over the n private keys (4-D layout, float32; float64 for reference). Build = `add` in 4096-row chunks + "
        "`finalize` (features, exact state/tree, noise), wall clock (median of 2-3 for state, 1 for tree). "
        f"Build ratio: {speed['definition']}. Peak = peak memory above the start of the build "
        "(`benchmarks.lib.measure.PeakMemory`; CPU: the kernel's resident-set high-water mark VmHWM, reset "
        "through /proc/self/clear_refs after malloc_trim, minus the resident set at the start; CUDA: "
        "allocator peak). K/V bytes = the private part's K and V "
        "in fp32 (a KV cache stores them in fp16/bf16: half that)."),
        "",
        table(
            ["n", "exact q tok/s fp32", "exact q tok/s fp64", "state q tok/s", "state feat ms", "state speedup",
             "tree q tok/s", "tree speedup", "exact prefill s", "state build s", "tree build s",
             "state build / prefill", "tree build / prefill"],
            [
                [r["n"], r["exact_tokens_per_s"], settings.m / r["exact_query_fp64_s"], r.get("state_tokens_per_s"),
                 r["state_features_s"] * 1e3,
                 r.get("state_speedup"), r.get("tree_tokens_per_s", r.get("tree_status")), r.get("tree_speedup"),
                 r["exact_prefill_s"], r["state_build_s"], r.get("tree_build_s", r.get("tree_status")),
                 r["state_build_over_prefill"], r.get("tree_build_over_prefill")]
                for r in rows
            ],
        ),
        "",
        table(
            ["n", "K/V MiB (fp32)", "state r", "state release MiB", "state peak build MiB", "tree r",
             "tree release MiB", "tree peak build MiB", "tree status"],
            [
                [r["n"], r["kv_bytes_fp32"] / 2**20, r["state_r"], r["state_release_bytes"] / 2**20,
                 r["state_peak_bytes"] / 2**20, r["tree_r"],
                 r["tree_release_nbytes"] / 2**20 if "tree_release_nbytes" in r else "n/a",
                 r["tree_peak_bytes"] / 2**20 if "tree_peak_bytes" in r else "n/a", r["tree_status"]]
                for r in rows
            ],
        ),
        "",
    ]
    return out


def default_notes(results: dict, settings: Settings) -> list[str]:
    notes: list[str] = []
    acc = results.get("accuracy")
    if acc:
        notes += acc["notes"]
        tree_ok = [r for r in acc["records"] if r["mode"] == "tree" and r["status"] == "ok"]
        if tree_ok:
            worst = max(r["den_nonpos_frac"] for r in tree_ok)
            med = float(np.median([r["noise_rel_median"] for r in tree_ok]))
            spent = {(r["eps"]): r["spent_epsilon"] for r in tree_ok}
            notes.append(
                f"Tree mode (faithful DPTree, l=1) is noise-dominated at every size run: median served noise "
                f"error {fmt(med)} across configs, up to {100 * worst:.0f}% of denominators <= 0 before the clamp; its "
                "outputs are essentially the clamp (the DPTree's node noise is predicted at 1e4-1e6x the signal)."
            )
            under = [f"{eps:g}->{fmt(s)}" for eps, s in sorted(spent.items()) if s < 0.99 * eps]
            if under:
                notes.append(
                    "The tree cascade spends less than asked (paper's eps/3 splits; asked->spent per head: "
                    + ", ".join(under) + "): its accuracy is at the *spent* eps, the table compares at the asked eps."
                )
        notes.append(
            "Exact attention on the mapped inputs equals E0 here (the paper setting needs no clipping), so "
            "E1 vs E0 = 0; the kernel error E2 vs E1 is deterministic (no seeds)."
        )
    real = results.get("real")
    if real and real.get("layers"):
        eps_list = real["settings"]["epsilons"]
        for name in real["variants"]:
            rows = [r for r in real["layers"] if r["variant"] == name]
            parts = []
            for eps in eps_list:
                vals = [r[f"total@{eps:g} med"] for r in rows if f"total@{eps:g} med" in r]
                if vals:
                    parts.append(f"eps={eps:g}: {fmt(min(vals))}..{fmt(max(vals))}")
            kern = [r["kernel med"] for r in rows if "kernel med" in r]
            if parts:
                notes.append(
                    f"Real heads, {name}: per-layer median relative row error of the DP output vs exact "
                    f"attention {'; '.join(parts)} (kernel error alone {fmt(min(kern))}..{fmt(max(kern))}). "
                    "Real heads are far out of the paper's regime (T >> 1): an error near or above 1 means "
                    "the output carries no usable signal."
                )
    speed = results.get("speed")
    if speed:
        share = [r["state_features_s"] / r["state_query_s"] for r in speed["rows"] if r.get("state_query_s")]
        if share:
            notes.append(
                f"State query time is dominated by the Taylor feature map of the queries "
                f"(`TaylorFeatures.__call__`: median {100 * float(np.median(share)):.0f}% of `att.query`, "
                "a gather of [m, r, s] monomial factors); the contraction itself is ~1 ms on CPU."
            )
        if settings.device == "cpu":
            notes.append(
                "Timings on this shared 2-core VM are noisy (identical back-to-back runs differed by 2-10x "
                "on individual calls while developing this suite); the tables report medians over >= 5 calls "
                "for queries but single wall-clock runs for tree builds and large prefills."
            )
    if results.get("speed"):
        notes.append(
            "State query cost is independent of n (one [m, r] x [r, d+1] contraction, r = 2145 at d=64), "
            "so its advantage grows linearly with n; the tree query gathers r features x 3 moments x (d+1) "
            "columns per query token, also independent of n. On CPU the tree build is dominated by "
            "truncated-Laplace sampling of ~6 r (d+1) n node noises (`LaplaceNoise.sample`)."
        )
    return notes


# --------------------------------------------------------------------------- plots
def _at_least_a_decade(ax) -> None:
    """Log axes spanning < 10x make flat curves look steep: widen them to one decade."""
    lo, hi = ax.get_ylim()
    if lo > 0 and hi / lo < 10:
        mid = math.sqrt(lo * hi)
        ax.set_ylim(mid / math.sqrt(10), mid * math.sqrt(10))


def plot(results: dict, stem: Path) -> list[Path]:
    acc = results.get("accuracy")
    if not acc:
        return []
    plt = pyplot()
    ok = [r for r in acc["records"] if r["status"] == "ok"]
    slopes = {(s["mode"], s["d"], s["eps"]): s for s in acc["slopes"]}
    ds = sorted({r["d"] for r in ok})
    paths = []
    fig, axes = plt.subplots(len(ds), 2, figsize=(11, 4.2 * len(ds)), squeeze=False)
    for i, d in enumerate(ds):
        for j, mode in enumerate(MODES):
            ax = axes[i][j]
            for eps in sorted({r["eps"] for r in ok}):
                rows = sorted((r for r in ok if (r["mode"], r["d"], r["eps"]) == (mode, d, eps)), key=lambda r: r["n"])
                if not rows:
                    continue
                ns = [r["n"] for r in rows]
                slope = slopes.get((mode, d, eps), {})
                line = ax.loglog(ns, [r["noise_rel_median"] for r in rows], "o-", label=f"eps={eps:g} noise (slope {fmt(slope.get('noise_slope'))})")
                ax.loglog(ns, [r["den_noise_rel_median"] for r in rows], "x:", color=line[0].get_color(), label=f"eps={eps:g} den noise (slope {fmt(slope.get('den_slope'))})")
            _finish_axes(ax, f"{mode}, d={d}: noise error vs n (median)", "context length n", "relative error")
    paths.append(_save(fig, stem, "error-vs-n"))

    fig, axes = plt.subplots(len(ds), 2, figsize=(11, 4.2 * len(ds)), squeeze=False)
    for i, d in enumerate(ds):
        for j, mode in enumerate(MODES):
            ax = axes[i][j]
            for n in sorted({r["n"] for r in ok}):
                rows = sorted((r for r in ok if (r["mode"], r["d"], r["n"]) == (mode, d, n)), key=lambda r: r["eps"])
                if rows:
                    ax.loglog([r["eps"] for r in rows], [r["rel_median"] for r in rows], "o-", label=f"n={n} (DP output vs exact)")
            _finish_axes(
                ax, f"{mode}, d={d}: median relative row error vs eps", "epsilon per head", "median ||O~ - O|| / ||O||"
            )
    paths.append(_save(fig, stem, "error-vs-eps"))
    return paths


def _finish_axes(ax, title: str, xlabel: str, ylabel: str) -> None:
    _at_least_a_decade(ax)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "not run", ha="center", transform=ax.transAxes)


def _save(fig, stem: Path, suffix: str) -> Path:
    fig.tight_layout()
    return save_figure(fig, suffixed(stem, f"-{suffix}.png"), dpi=110)


# --------------------------------------------------------------------------- files
def write_results(results: dict, settings: Settings) -> list[Path]:
    stem = Path(settings.out) / f"attention-{device_label(settings.device, short=True)}-{settings.date}"
    files = [write_json(suffixed(stem, ".json"), results, indent=1)]
    acc = results.get("accuracy")
    if acc:
        files.append(suffixed(stem, "-accuracy.csv"))
        write_csv(files[-1], acc["records"])
        files.append(suffixed(stem, "-sources.csv"))
        write_csv(files[-1], acc["sources"])
    if results.get("real"):
        files.append(suffixed(stem, "-real-heads.csv"))
        write_csv(files[-1], results["real"]["rows"])
    if results.get("speed"):
        files.append(suffixed(stem, "-speed.csv"))
        write_csv(files[-1], results["speed"]["rows"])
    files += plot(results, stem)
    md = suffixed(stem, ".md")
    write_text(md, markdown(results, settings, [md] + files))
    results["files"] = [str(p) for p in [md] + files]
    return [md] + files


def load_results(path: Path) -> tuple[dict, Settings]:
    """A saved results JSON and the settings it ran with (targets and notes are recomputed)."""
    results = read_json(path)
    saved = dict(results["settings"])
    saved["out"] = Path(path).parent
    saved["tree_plan"] = TreePlan(saved.get("tree_plan", "default"))
    for key, value in saved.items():
        if isinstance(value, list):
            saved[key] = tuple(value)
    known = set(Settings.__dataclass_fields__)
    settings = Settings(**{k: v for k, v in saved.items() if k in known})
    results["targets"] = targets(results)
    results["notes"] = default_notes(results, settings)
    return results, settings


def write_csv(path: Path, rows: Sequence[dict]) -> Path | None:
    """One row per dict; the columns are every scalar key in first-seen order (list and dict
    values are left out). Nothing is written for no rows (None)."""
    if not rows:
        return None
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys and not isinstance(row[k], (list, dict))]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path
