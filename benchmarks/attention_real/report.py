"""The report of ``python -m benchmarks.attention_real``: per-layer rows, their summaries, the markdown, the
plot and the terminal summary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from benchmarks.attention_real.measures import LayerStats
from benchmarks.attention_real.parts import DELTA, Condition, Plans
from vllm_dp_plugin.benchmarks.lib.report import fmt, pyplot, save_figure, table

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
    lines = [f"# python -m benchmarks.attention_real ({data['device']}, {data['date']})", "",
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
    fig.suptitle(f"python -m benchmarks.attention_real: {Path(data['model']).name}, {data['device']}", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


def _pos(x):
    return x if x is not None and x > 0 else float("nan")


def summary(data: dict) -> str:
    """A few lines for the terminal: layer means of the key numbers and the end-to-end table."""
    agg = data["aggregate"]
    parts = [f"sink mass pos0 {fmt(agg['sinks']['mass_pos0']['mean'])}, head {fmt(agg['sinks']['mass_head']['mean'])}",
             "DP part out err (kernel) bare " + fmt(agg["bare"]["out_rel_error"]["kernel"]["mean"])
             + ", head " + fmt(agg["head"]["out_rel_error"]["kernel"]["mean"]),
             "merged err: " + ", ".join(f"{c} {fmt(v['mean'])}" for c, v in agg["merged_rel_error"].items())]
    e2e = ", ".join(f"{r['condition']} {fmt(r['agreement'])}" for r in data["end_to_end"])
    return "\n".join([*parts, f"teacher-forced agreement: {e2e}"])
