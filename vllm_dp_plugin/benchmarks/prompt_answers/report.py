"""The report of ``vllm-dp bench prompt-answers``: result files, markdown, notes and the plot."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from vllm_dp_plugin.prompt.mechanisms import MECHANISMS, REPRODUCTION

from ..lib.report import fmt, pyplot, save_figure, suffixed, write_json, write_text
from ..lib.report import table as md_table
from .privatizers import BASELINES, METRIC_DP, NO_QUESTION, REFERENCE
from .questions import KINDS


def stem(results: dict) -> Path:
    """``<out>/prompt-answers-<device>-<date>``: the result files' path without suffix."""
    return Path(results["settings"]["out"]) / f"prompt-answers-{results['device']}-{results['settings']['date']}"


def write_results(results: dict) -> list[Path]:
    """The md, json and png files of ``results`` (their paths and notes added to it)."""
    files = [suffixed(stem(results), suffix) for suffix in (".md", ".json", ".png")]
    results["files"] = [str(p) for p in files]
    results["notes"] = notes(results)
    write_json(files[1], results)
    plot(results, files[2])
    write_text(files[0], markdown(results))
    return files


def _grid(results: dict) -> list[float]:
    return sorted({r["eps"] for r in results["rows"] if r["eps"] is not None})


def _baseline_row(results: dict, name: str) -> dict | None:
    return next((r for r in results["rows"] if r["mechanism"] == name and "error" not in r), None)


def _mechanism_rows(results: dict) -> list[dict]:
    return [r for r in results["rows"] if r["mechanism"] not in BASELINES]


def _label(name: str) -> str:
    if name in METRIC_DP:
        return f"{name} (at eps = eps_m * Delta)"
    if name in REPRODUCTION:
        return f"{name} (claimed eps; not DP)"
    return "paraphrase (eps per OUTPUT token, cap 32)" if name == "paraphrase" else name


def _pivot(results: dict, cell: Callable[[dict], str]) -> list[list[str]]:
    rows = _mechanism_rows(results)
    by = {(r["mechanism"], r["eps"]): r for r in rows}
    return [[_label(m)] + [("n/a" if "error" in by[(m, e)] else cell(by[(m, e)])) if (m, e) in by else ""
                          for e in _grid(results)] for m in dict.fromkeys(r["mechanism"] for r in rows)]


def _receipt_cell(r: dict) -> str:
    """``eps (delta)`` of the receipt's total; reproductions state no guarantee (their claim is shown)."""
    eps = r.get("total_epsilon")
    if eps is None or math.isinf(eps):
        claimed = r.get("claimed_total_epsilon")
        return "no guarantee" + (f" (claimed {fmt(claimed)})" if claimed is not None else "")
    return f"{fmt(eps)} ({fmt(r.get('total_delta'))})"


def markdown(results: dict) -> str:
    """The result's markdown: what was run, accuracy per kind, tokens kept, receipts, examples."""
    info, data, s, engine, table = (results[k] for k in ("machine", "data", "settings", "engine", "table"))
    ref, floor = _baseline_row(results, REFERENCE), _baseline_row(results, NO_QUESTION)
    heads = ["mechanism"] + [f"eps={e:g}" for e in _grid(results)]
    stages = ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in results["timing"].items())
    desc = f"{info.get('cpu', '?')}, {info['cpu_count']} logical cores, {info.get('ram_gib', '?')} GiB RAM"
    if "gpu" in info:
        desc = f"{info['gpu']}; host {desc}"
    q, (lo, mean, hi) = data["questions"], data["question_tokens"]
    out = [
        f"# Prompt privatization: answer accuracy on {Path(s['model']).name} ({info['label']}, {s['date']})",
        "",
        f"- Machine: {desc}; {info['platform']}",
        f"- Python {info['python']}, torch {info['torch']}, vLLM {engine['vllm']}",
        f"- Command: `{s['command']}`",
        (f"- Wall time: {results['runtime_s'] / 60:.1f} min ({stages}; privatize includes the diameters and "
         "the reproduction modes' true-delta search)" + (" (**--quick**: smoke-test sizes)" if s["quick"] else "")),
        (f"- Questions: {data['scenarios']} scenarios of `{Path(s['scenarios']).name}`: {q['public']} public "
         f"(no system prompt), {q['shared']} shared and {q['secret']} secret (the scenario's documents as a "
         f"plain system prompt, one per line; NOT private here). Private: the user's question only, "
         f"{lo}/{mean:.1f}/{hi} tokens (min/mean/max), located as the server's renderer does "
         "(`segment_chat`); template and system prompt pass through."),
        (f"- Privatization: the plugin's `PromptPrivacy` service of the model "
         f"(`build_prompt_privacy`; table: {table.get('describe', 'n/a')}), one `privatize` call per question "
         f"with `dp_mechanism`/`dp_epsilon`, noise seeded per (mechanism, eps, question) from seed {s['seed']}; "
         f"delta = {s['delta']:g} per token for trlap_corrected and gaussian_analytic."),
        (f"- Generation: offline vLLM ({', '.join(f'{k}={v}' for k, v in engine['llm'].items())}), "
         f"VLLM_PLUGINS={engine['vllm_plugins']!r}, greedy, {s['max_tokens']} tokens, token-id "
         "prompts, one `generate` call per row. Correct: one of the question's answers occurs in the "
         "completion (case-insensitive)."),
        "",
        f"![answer accuracy vs eps]({Path(results['files'][2]).name})",
        "",
        ("Per-token eps on the grid is what each mechanism guarantees per token (any token vs any token). "
         "`mahalanobis`/`cmp` (metric DP) are run at eps_m = eps / Delta (Delta: the table's diameter in "
         "their metric), so their converted guarantee equals the grid value. `trlap_paper`/`trlap_repro` "
         "are reproductions whose claimed delta is false: not DP, shown at the claimed eps (their receipt "
         "states no guarantee: total eps inf). n/a: the calibration is undefined at that eps."),
        "",
    ]
    for kind in [k for k in KINDS if ref is not None and f"{k}_accuracy" in ref]:
        key, (lo_ci, hi_ci) = f"{kind}_accuracy", ref[f"{kind}_ci"]
        removed = (f"; question removed (empty user turn, the eps -> 0 end): {floor[key]:.2f}"
                   if floor is not None and key in floor else "")
        out += [f"## Answer accuracy, {kind} questions (n = {ref[f'{kind}_n']})", "",
                (f"Reference (un-privatized question): **{ref[key]:.2f}** (95% CI [{lo_ci:.2f}, {hi_ci:.2f}])"
                 f"{removed}."), "",
                md_table(heads, _pivot(results, lambda r, k=key: f"{r[k]:.2f}" if k in r else "")), ""]
    out += [
        "## Question tokens unchanged (fraction, at their position)",
        "",
        md_table(heads, _pivot(results, lambda r: f"{r['unchanged']:.2f}")),
        "",
        "## What the receipt says was spent for the whole question",
        "",
        ("`receipt.prompt.total` (the smaller of basic and advanced composition over the question's "
         "private tokens), mean over questions: epsilon (delta). Reproduction modes: the receipt states no "
         "guarantee; their claim (n x the claimed per-token eps) is in brackets."),
        "",
        md_table(heads, _pivot(results, _receipt_cell)),
        "",
    ]
    metric = [r for r in _mechanism_rows(results) if r["mechanism"] in METRIC_DP and "service_epsilon" in r]
    if metric:
        out += ["Metric epsilon eps_m sent as `dp_epsilon` for the metric-DP rows (diameters: "
                + ", ".join(f"{k} = {fmt(table[k], 5)}" for k in ("sensitivity_l2", "mahalanobis_diameter")
                            if k in table) + "):", "",
                md_table(heads, _pivot({"rows": metric}, lambda r: fmt(r["service_epsilon"], 4))), ""]
    repro = [r for r in _mechanism_rows(results) if r["mechanism"] in REPRODUCTION]
    if repro:
        out += [("Reproduction rows (not DP): per-token delta the receipt states (true delta, lower bound) "
                 "and trlap_paper's d_eff:"), "",
                md_table(["mechanism", "eps (claimed)", "d_eff", "true delta per token >=", "status"], [
                    [r["mechanism"], f"{r['eps']:g}", r.get("effective_dim", ""), fmt(r.get("delta_token")),
                     "ok" if "error" not in r else "undefined: " + r["error"][:120]] for r in repro]), ""]
    errors = [r for r in results["rows"] if "error" in r]
    if errors:
        out += ["## Rows that could not run (n/a)", ""] + [
            f"- {r['mechanism']} eps={r['eps']:g}: {r['error'][:300]}" for r in errors] + [""]
    if results["examples"]:
        out += ["## Examples (first question of each kind)", ""]
        heads_ex = ["row"] + [f"{e['kind']} `{e['question']}`" for e in next(iter(results["examples"].values()))]
        out += [md_table(heads_ex, [
            [k.replace("@-", "").replace("@", " eps=")]
            + [f"{_quote(e['text'])} -> {_quote(e['answer'][:80])} {'(correct)' if e['correct'] else ''}"
               for e in ex]
            for k, ex in results["examples"].items()]), ""]
    out += ["## Notes", ""] + [f"- {n}" for n in results["notes"]] + [""]
    out += ["## Files", ""] + [f"- `{Path(p).name}`" for p in results["files"]] + [""]
    return "\n".join(out)


def _quote(text: str) -> str:
    return '"' + " ".join(text.split()).replace("|", "\\|") + '"'


def notes(results: dict) -> list[str]:
    """Per kind, the smallest eps at which each mechanism reaches 90% of the reference accuracy."""
    ref, rows = _baseline_row(results, REFERENCE), _mechanism_rows(results)
    if ref is None:
        return ["the reference row failed: no comparison possible"]
    lines = []
    for kind in [k for k in ("shared", "public") if f"{k}_accuracy" in ref]:
        key, found = f"{kind}_accuracy", []
        for name in dict.fromkeys(r["mechanism"] for r in rows):
            reached = [r["eps"] for r in rows if r["mechanism"] == name and r.get(key, -1) >= 0.9 * ref[key]]
            found.append(f"`{name}` " + (f"eps = {min(reached):g}" if reached else "never on this grid"))
        lines.append(f"{kind}: smallest per-token eps reaching 90% of the reference accuracy "
                     f"({ref[key]:.2f}): " + ", ".join(found) + ".")
    return lines


def plot(results: dict, path: Path) -> None:
    """Top: accuracy vs per-token eps, one panel per kind; bottom: accuracy vs the receipt's total
    eps for the whole question (log x; reproductions at n x the claimed eps). Reference dashed."""
    plt = pyplot()
    ref, floor = _baseline_row(results, REFERENCE), _baseline_row(results, NO_QUESTION)
    kinds = [k for k in KINDS if ref is not None and f"{k}_accuracy" in ref] or list(KINDS)
    fig, axes = plt.subplots(2, len(kinds), figsize=(6 * len(kinds), 9.5), squeeze=False)
    rows = _mechanism_rows(results)
    names = list(dict.fromkeys(r["mechanism"] for r in rows))
    order = list(dict.fromkeys((*MECHANISMS, *names)))  # colours and markers by mechanism
    handles = {}
    for col, kind in enumerate(kinds):
        key = f"{kind}_accuracy"
        for name in names:
            pts = sorted((r for r in rows if r["mechanism"] == name and key in r), key=lambda r: r["eps"])
            if not pts:
                continue
            i = order.index(name)
            style = {"ls": "--" if name in METRIC_DP else (":" if name in REPRODUCTION else "-"),
                     "marker": "osD^vP*Xph"[i % 10], "ms": 5, "mfc": "none", "color": plt.get_cmap("tab10")(i % 10)}
            (handles[name],) = axes[0][col].plot([r["eps"] for r in pts], [r[key] for r in pts], label=_label(name),
                                                 **style)
            x_key = "claimed_total_epsilon" if name in REPRODUCTION else "total_epsilon"
            total = [(r[x_key], r[key]) for r in pts if r.get(x_key) is not None and 0 < r[x_key] < math.inf]
            if total:
                axes[1][col].plot(*zip(*total, strict=True), **style)
        for ax in (axes[0][col], axes[1][col]):
            if ref is not None and key in ref:
                handles["reference"] = ax.axhline(ref[key], color="black", ls="--", lw=1.2,
                                                  label="un-privatized question (reference)")
            if floor is not None and key in floor:
                handles["floor"] = ax.axhline(floor[key], color="grey", ls=":", lw=1.2,
                                              label="question removed (the eps -> 0 end)")
            ax.set(ylim=(-0.02, 1.02), xscale="log", ylabel=f"{kind} answer accuracy")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][col].set(title=f"{kind} questions (n = {ref.get(f'{kind}_n', '?') if ref else '?'})",
                         xlabel="per-token eps (metric DP: eps_m * Delta; reproductions: claimed)")
        axes[1][col].set_xlabel("receipt total eps for the whole question (mean; reproductions: n x claimed)")
    fig.legend(handles=list(handles.values()), loc="lower center", ncol=5, fontsize=8, frameon=False)
    data = results["data"]
    fig.suptitle(f"Answer accuracy on privatized questions, {Path(results['settings']['model']).name}: "
                 f"{data['scenarios']} scenarios, {sum(data['questions'].values())} questions", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    save_figure(fig, path, dpi=100)
