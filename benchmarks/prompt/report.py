"""The report of ``python -m benchmarks.prompt``: markdown, JSON and the plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.prompt.analysis import (
    _eps,
    bound_curves,
    checks,
    eps_for,
    eps_for_bound,
    eps_grid,
    notes,
)
from benchmarks.prompt.data import MODEL_PACKAGE
from benchmarks.prompt.mechanisms import METRIC_DP, REPRODUCTION
from benchmarks.prompt.settings import Settings
from vllm_dp_plugin.benchmarks.lib.environment import device_label
from vllm_dp_plugin.benchmarks.lib.report import (
    fmt,
    pyplot,
    save_figure,
    suffixed,
    write_json,
    write_text,
)
from vllm_dp_plugin.benchmarks.lib.report import table as md_table
from vllm_dp_plugin.privacy.trlaplace import REPO_DELTA_ROOT
from vllm_dp_plugin.prompt import MECHANISMS


def write_results(results: dict, settings: Settings) -> list[Path]:
    stem = Path(settings.out) / f"prompt-utility-{device_label(settings.device, short=True)}-{settings.date}"
    files = [suffixed(stem, ".md"), suffixed(stem, ".json"), suffixed(stem, ".png")]
    results["bounds"] = bound_curves(results, eps_grid(results))
    results["checks"] = checks(results)
    results["notes"] = notes(results)
    results["files"] = [str(p) for p in files]
    write_json(files[1], results, indent=1)
    plot(results, files[2])
    write_text(files[0], markdown(results, settings))
    return files


def _ci(value: float, ci: Sequence[float]) -> str:
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def _pivot(results: dict, cell) -> list[list]:
    grid = eps_grid(results)
    by = {(r["mechanism"], r["eps"]): r for r in results["rows"]}
    mechs = list(dict.fromkeys(r["mechanism"] for r in results["rows"]))
    return [[m] + [cell(by[(m, e)]) if (m, e) in by else "" for e in grid] for m in mechs]


def markdown(results: dict, settings: Settings) -> str:
    info, data, table, ref = results["machine"], results["data"], results["table"], results["reference"]
    s = results["settings"]
    grid = eps_grid(results)
    stages = ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in results["timing"].items())
    desc = f"{info.get('cpu', '?')}, {info['cpu_count']} logical cores, {info.get('ram_gib', '?')} GiB RAM"
    if "gpu" in info:
        desc = f"{info['gpu']}; host {desc}"
    sens = (f"Delta_1 = {fmt(table['sensitivity_l1'], 4)}, Delta_inf = {fmt(table['sensitivity_linf'], 4)}")
    if "sensitivity_l2" in table:
        sens += f", Delta_2 = {fmt(table['sensitivity_l2'], 5)} (exact l2 diameter)"
    if "mahalanobis_diameter" in table:
        sens += (f", Mahalanobis (lambda = {s['mahalanobis_lambda']:g}) diameter "
                 f"{fmt(table['mahalanobis_diameter'], 5)}")
    lo, mean, hi = data["pieces_per_sentence"]
    out = [
        f"# Prompt privatization: utility vs epsilon ({info['device']}, {settings.date})",
        "",
        f"- Machine: {desc}; {info['platform']}",
        f"- Python {info['python']}, torch {info['torch']} ({info['torch_threads']} intra-op threads)",
        f"- Command: `{s['command']}`",
        (f"- Wall time of this run: {results['runtime_s'] / 60:.1f} min ({stages})"
         + (" (**--quick**: smoke-test sizes)" if s["quick"] else "")),
        (f"- Vocabulary: all-MiniLM-L6-v2 wordpieces (package `{MODEL_PACKAGE}`): V = {table['vocab_size']} "
         f"input-domain rows, d = {table['dim']}; {table['special']} special/unused ids (`[...]`) are never "
         f"output (K = {table['candidates']} candidates); ln V = {table['ln_V']:.2f}. Table centred and clipped "
         f"at the {table['clip_quantile']:g} quantile of row norms: C = {fmt(table['clip_norm'], 4)}; {sens}."),
        (f"- Text: {data['sentences']} sentences sampled without replacement (random.Random({s['seed']})) from "
         f"the {data['pool']} distinct prose sentences of {data['source']} with {s['min_pieces']}-"
         f"{s['max_pieces']} wordpieces and >= {s['min_alpha']:g} letters/spaces: {data['tokens']} privatized "
         f"pieces ({data['distinct_pieces']} distinct; {lo}/{mean:.1f}/{hi} min/mean/max per sentence); "
         "[CLS]/[SEP] pass through."),
        (f"- Noise: one `privatize` call per (mechanism, eps) over all sentences, generator seed "
         f"crc32('{s['seed']}/<mechanism>/<eps>'); delta = {s['delta']:g} per token for trlap_corrected and "
         f"gaussian_analytic. CIs: 95% percentile bootstrap over sentences ({s['bootstrap']} resamples, numpy "
         f"seed {s['seed']})."),
        (f"- Sentence embedding: the package's BertModel, mean pooling over the attention mask, l2-normalised; "
         f"cosine of original vs privatized. Reference: unrelated sentence pairs (each sentence vs another "
         f"sampled sentence) have cosine {_ci(ref['unrelated_cosine'], ref['unrelated_cosine_ci'])}."),
        "",
        f"![utility vs eps]({Path(results['files'][2]).name})",
        "",
        "## How the mechanisms share one eps axis",
        "",
        ("The x axis is the per-token epsilon each mechanism guarantees (any token vs any token of the "
         "vocabulary, the paper's Def 2):"),
        "",
        "- `trlap_corrected`, `gaussian_analytic`: (eps, delta)-DP; `laplace`, `expmech`: pure eps-DP.",
        ("- `mahalanobis`, `cmp` (metric DP, eps_m per unit distance): run at eps_m = eps / Delta_2, so that "
         "the converted guarantee eps_DP = eps_m * Delta_2 (Delta_2 = input-domain diameter in the "
         "mechanism's metric) equals the grid eps; their nominal eps_m is in a table below. Comparing them "
         "at equal *nominal* eps (as the paper's Fig 4 does) would be invalid."),
        ("- `trlap_paper`, `trlap_repro`: plotted at their CLAIMED eps, which is not a guarantee (their "
         "claimed delta is false, see below). `trlap_paper` pads to Remark 1's smallest dummy dimension "
         "d_eff = max(d, 4 eps^2) (claimed delta 4^-d_eff); `trlap_repro` uses the authors' d_eff switch "
         "(500 at eps = 10, 1700 above 8.6) and is undefined (Thm 3 needs p <= 1) above "
         "eps = 2 * (1/4) * sqrt(1700) = 20.6."),
        "",
        "## Token preservation N_w (95% CI)",
        "",
        md_table(["mechanism"] + [f"eps={e:g}" for e in grid], _pivot(
            results, lambda r: _ci(r["preservation"], r["preservation_ci"]) if "preservation" in r else "n/a")),
        "",
        md_table(["reference (any DP mechanism)"] + [f"eps={e:g}" for e in grid], [
            ["DP vocabulary-average keep bound (e^eps + V delta)/V"]
            + [b["vocab_bound"] for b in results["bounds"]],
            ["same budget e^eps + V delta spent on this text's most frequent pieces (bound on E[N_w])"]
            + [b["text_bound"] for b in results["bounds"]],
        ]),
        "",
        "## Sentence-embedding cosine, original vs privatized (95% CI)",
        "",
        md_table(["mechanism"] + [f"eps={e:g}" for e in grid], _pivot(
            results, lambda r: _ci(r["cosine"], r["cosine_ci"]) if "cosine" in r else "n/a")),
        "",
    ]
    metric_rows = [r for r in results["rows"] if r["mechanism"] in METRIC_DP and r.get("metric_epsilon")]
    if metric_rows:
        out += [
            "Nominal metric epsilon eps_m (per unit distance) of the metric-DP runs:",
            "",
            md_table(["mechanism"] + [f"eps_DP={e:g}" for e in grid],
                   _pivot({"rows": metric_rows}, lambda r: r["metric_epsilon"])),
            "",
        ]
    repro = [r for r in results["rows"] if r["mechanism"] in REPRODUCTION]
    if repro:
        out += [
            "## Claimed vs true delta of the paper's calibration (its Thm 3 is false for d > 1)",
            "",
            ("True delta = the exact maximum of the pairwise delta over an evenly spaced subset of the "
             "input domain (the library's `reproduction_delta`; all V^2 pairs are too many), hence a LOWER "
             "bound on the mechanism's delta. Claimed delta = 4^-d_eff."),
            "",
            md_table(["mechanism", "eps (claimed)", "d_eff", "claimed delta", "true delta >=", "N_w", "cosine",
                    "status"], [
                [r["mechanism"], f"{r['eps']:g}", r.get("effective_dim", "n/a"),
                 f"4^-{r['effective_dim']} = 10^{r['claimed_log10_delta']:.4g}" if "claimed_log10_delta" in r
                 else "n/a",
                 r.get("delta", "n/a"), r.get("preservation", "n/a"), r.get("cosine", "n/a"),
                 "ok" if "error" not in r else "undefined: " + r["error"].split(";")[0]]
                for r in repro
            ]),
            "",
        ]
    if results["examples"]:
        eps_cols = sorted({float(e) for ex in results["examples"].values() for e in ex})
        out += [
            "## Example (first sampled sentence)",
            "",
            f"Original: \"{data['first_sentence']}\"",
            "",
            md_table(["mechanism"] + [f"eps={e:g}" for e in eps_cols], [
                [m] + [ex.get(f"{e:g}", "n/a").replace("|", "\\|") for e in eps_cols]
                for m, ex in results["examples"].items()
            ]),
            "",
        ]
    out += ["## Checks", ""] + [f"- {n}" for n in results["notes"]] + [""]
    out += ["## What this means", ""] + what_it_means(results) + [""]
    out += ["## Files", ""] + [f"- `{Path(p).name}`" for p in results["files"]] + [""]
    return "\n".join(out)


def what_it_means(results: dict) -> list[str]:
    table, rows = results["table"], results["rows"]
    ln_v, vocab = table["ln_V"], table["vocab_size"]
    delta = results["settings"]["delta"]
    freqs = results["reference"]["piece_frequencies"]
    pieces = results["data"]["pieces_per_sentence"][1]
    mechs = list(dict.fromkeys(r["mechanism"] for r in rows))
    vocab_half = math.log(vocab * (0.5 - delta))
    text_half = eps_for_bound(freqs, 0.5, delta, vocab)
    ranked = sorted(
        (e, m) for m in mechs if m not in REPRODUCTION
        for e in [eps_for(rows, m, "preservation", 0.5)] if e is not None
    )
    never = [m for m in mechs if m not in REPRODUCTION and eps_for(rows, m, "preservation", 0.5) is None]
    ranking = ", ".join(f"`{m}` {e:g}" for e, m in ranked) + (
        f"; never on this grid: {', '.join(f'`{m}`' for m in never)}" if never else "")
    out = [
        (f"Every eps here is PER TOKEN: one privatized wordpiece is (eps, delta)-indistinguishable from any "
         f"other of the V = {vocab} pieces. A sentence of n private pieces composes to n * eps (basic "
         f"composition; advanced composition does not help at eps >= 1): at eps = ln V = {ln_v:.1f}, where "
         f"utility can start, a {pieces:.0f}-piece sentence spends ~{pieces * ln_v:.0f}. Read it as per-token "
         "plausible deniability, not as a small sentence-level epsilon."),
        "",
        (f"The DP keep bound caps every DP mechanism, whatever its design: the vocabulary-average keep rate reaches 0.5 only "
         f"at eps = ln(V/2) = {vocab_half:.1f}; on this text the cap on E[N_w] reaches 0.5 at eps = "
         f"{_eps(text_half) if text_half is None else f'{text_half:.1f}'} (frequent pieces such as 'the' are "
         f"cheap to keep). Smallest grid eps at which each mechanism with a real guarantee keeps half the "
         f"pieces (N_w >= 0.5): {ranking or 'none'}."),
    ]
    repro = [r for r in rows if r["mechanism"] in REPRODUCTION and "delta" in r]
    if repro:
        worst = max(repro, key=lambda r: r["delta"])
        out += ["", (
            f"`trlap_paper`/`trlap_repro` do not have the delta they claim: the largest true per-token delta "
            f"found is >= {worst['delta']:.3g} ({worst['mechanism']} at eps = {worst['eps']:g}, claimed "
            f"10^{worst['claimed_log10_delta']:.4g}), so those points are not DP at the plotted eps; use "
            "`trlap_corrected` for the truncated Laplace with a real guarantee.")]
        flat = [r for r in repro if r["mechanism"] == "trlap_paper" and r["delta"] == 0]
        if flat:
            out[-1] += (
                f" Where `trlap_paper` needs Remark 1's padding (eps > {2 * REPO_DELTA_ROOT * math.sqrt(table['dim']):.1f}), "
                "the smallest d_eff makes p = 1: the noise is untruncated Laplace of scale 2 sqrt(d_eff) C / eps = 4C "
                "at every eps, so its claim then holds (true delta 0) but its utility stays flat, as at "
                f"eps = Delta_1 / 4C = {table['sensitivity_l1'] / (4 * table['clip_norm']):.1f}.")
    return out


def plot(results: dict, path: Path) -> None:
    """Panels (i) N_w and (ii) sentence cosine vs eps per mechanism (95% CI bands) with the
    keep-rate bounds, (iii) claimed vs true delta of the reproduction modes."""
    plt = pyplot()
    rows = [r for r in results["rows"] if "preservation" in r]
    mechs = list(dict.fromkeys(r["mechanism"] for r in results["rows"]))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(MECHANISMS)}
    fig, axes = plt.subplots(1, 3, figsize=(19, 6.2))
    ln_v = results["table"]["ln_V"]
    handles = []
    for name in mechs:
        pts = sorted((r for r in rows if r["mechanism"] == name), key=lambda r: r["eps"])
        if not pts:
            continue
        style = "--" if name in METRIC_DP else (":" if name in REPRODUCTION else "-")
        label = name + (" (at eps_DP = eps_m * Delta_2)" if name in METRIC_DP
                        else " (at the claimed eps; not DP)" if name in REPRODUCTION else "")
        xs = [r["eps"] for r in pts]
        for ax, key in ((axes[0], "preservation"), (axes[1], "cosine")):
            lo = [r[f"{key}_ci"][0] for r in pts]
            hi = [r[f"{key}_ci"][1] for r in pts]
            (line,) = ax.plot(xs, [r[key] for r in pts], style, marker="o", ms=3.5, color=colors[name], label=label)
            ax.fill_between(xs, lo, hi, color=colors[name], alpha=0.15, lw=0)
        handles.append(line)
    grid = eps_grid(results)
    dense = [float(e) for e in np.geomspace(grid[0], grid[-1], 300)]
    curves = bound_curves(results, dense)
    refs = axes[0].plot(dense, [b["vocab_bound"] for b in curves], color="black", lw=1.6,
                        label="DP bound: vocabulary-average keep rate")
    refs += axes[0].plot(dense, [b["text_bound"] for b in curves], color="grey", lw=1.6, ls="-.",
                         label="DP bound on E[N_w] of this text")
    ref = results["reference"]
    unrelated = axes[1].axhline(ref["unrelated_cosine"], color="grey", ls="-.", lw=1.2,
                                label="unrelated sentence pairs")
    panels = ((axes[0], "(i) token preservation N_w", "fraction of privatized pieces kept"),
              (axes[1], "(ii) sentence-embedding cosine (MiniLM)", "cosine(original, privatized)"))
    for ax, title, ylabel in panels:
        ax.set_ylim(-0.02, 1.02)
        ax.axvline(ln_v, color="black", ls=":", lw=0.8)
        ax.text(ln_v * 1.05, 0.5, f"ln V = {ln_v:.1f}", fontsize=7, rotation=90)
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel("per-token eps (metric DP: eps_DP = eps_m * Delta_2)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[2]
    repro = [r for r in results["rows"] if r["mechanism"] in REPRODUCTION and "delta" in r]
    markers = {"trlap_paper": ("s", 8), "trlap_repro": ("o", 4)}
    for name in dict.fromkeys(r["mechanism"] for r in repro):
        pts = sorted((r for r in repro if r["mechanism"] == name), key=lambda r: r["eps"])
        marker, size = markers[name]
        ax.plot([r["eps"] for r in pts], [-r["claimed_log10_delta"] for r in pts], ":", marker=marker, ms=size,
                mfc="none", color=colors[name], label=f"{name}: claimed delta = 4^-d_eff")
        true = [(r["eps"], -math.log10(r["delta"])) for r in pts if r["delta"] > 0]
        if true:
            ax.plot(*zip(*true, strict=True), "-", marker=marker, ms=size, mfc="none", color=colors[name],
                    label=f"{name}: true delta (lower bound)")
        zero = [r["eps"] for r in pts if r["delta"] == 0]
        if zero:
            ax.plot(zero, [1e-3] * len(zero), "x", color=colors[name],
                    label=f"{name}: true delta = 0 (drawn at 1e-3; p = 1: plain Laplace)")
    ax.axhline(-math.log10(results["settings"]["delta"]), color=colors["trlap_corrected"], lw=1,
               label=f"trlap_corrected: delta = {results['settings']['delta']:g} (valid)")
    ax.axhline(-math.log10(0.5), color="red", lw=0.8, ls="--", label="delta = 0.5")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(top=max(ax.get_ylim()[1] * 100, 1e3))
    ax.set_title("(iii) claimed vs true per-token delta (the paper's Thm 3 fails for d > 1)")
    ax.set_xlabel("per-token eps (claimed)")
    ax.set_ylabel("-log10(delta)   (higher = smaller delta)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.legend(handles=handles + refs + [unrelated], loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"Prompt privatization on all-MiniLM-L6-v2 (V = {results['table']['vocab_size']}, d = "
                 f"{results['table']['dim']}): {results['data']['sentences']} pydoc sentences, "
                 f"{results['data']['tokens']} privatized pieces", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    save_figure(fig, path, dpi=110)
