"""The report of ``python -m benchmarks.train``: markdown and the plot."""

from __future__ import annotations

from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.report import pyplot, save_figure


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def _ratio(row: dict, key: str) -> str:
    return f"{row[key]:.2f}x" if key in row else "-"


def _setup_text(meta: dict) -> str:
    env = meta["env"]
    gpu = f", GPU {env['gpu']} (CUDA {env['cuda']})" if "gpu" in env else ""
    params = f"{meta['parameters']:,}" if meta["parameters"] else "?"
    if meta.get("model_path"):
        weights = (f"Pretrained weights from `{meta['model_path']}`" if not meta.get("random_weights") else
                   f"Random weights (seed {meta['seed']}) of `{meta['model_path']}`'s architecture (its config.json "
                   "alone: the times do not depend on the values)")
        data = f"{weights}, float32; a fixed batch of seeded uniform token ids from its vocabulary, `position_ids [B, T]`"
    else:
        data = "Random weights; synthetic seeded batch, fixed"
    lora = ""
    if meta.get("lora_parameters"):
        spec = meta["lora"]
        lora = (f" LoRA rows: `peft` adapters r = {spec['r']}, alpha = {spec['alpha']:g} on "
                f"{', '.join(spec['target_modules'])} ({meta['lora_parameters']:,} trainable parameters, the base "
                "frozen); their ratios are against non-private LoRA.")
    return (
        f"torch {env['torch']}, transformers {env['transformers']}, opacus {env['opacus']}"
        + (f", peft {env['peft']}" if env.get("peft") else "")
        + f", python {env['python']}, {env['torch_threads']} threads{gpu}.\n\n"
        f"Model: {meta['model']} ({params} parameters, the tied weight once). {data}; "
        f"DP methods: flat clipping C = {meta['clip_norm']}, noise multiplier {meta['noise_multiplier']}, Adam. "
        f"Step time: median of {meta['steps']} steps after {meta['warmup']} warm-up steps. Peak memory: "
        "parameters + the most the steps allocate above the level before the first step "
        f"({meta['memory_measure']}); each method in its own process.{lora}"
    )


def render_markdown(results: dict) -> str:
    meta, rows = results["meta"], results["methods"]
    autocast = " (bf16 autocast)" if meta["autocast"] == "bf16" else ""
    model = f", {meta['model_name']}" if meta.get("model_name") else ""
    lines = [
        f"# DP training step{model}: {meta['device']}{autocast} ({meta['date']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        _setup_text(meta),
        "",
        "| method | step time (ms) | min-max (ms) | peak memory (MiB) | vs non-private: time | memory | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] == "ok":
            lines.append(
                f"| {r['label']} | {r['step_s'] * 1e3:,.0f} | {min(r['times_s']) * 1e3:,.0f}-"
                f"{max(r['times_s']) * 1e3:,.0f} | {_mib(r['peak_bytes'])} | {_ratio(r, 'time_ratio')} | "
                f"{_ratio(r, 'memory_ratio')} | ok |"
            )
        else:
            lines.append(f"| {r['label']} | - | - | - | - | - | {r['status'].replace('|', '/')} |")
    lines += ["", "## Targets", "", "| target | measured | result |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured'].replace('|', '/')} | {t['result']} |" for t in results["targets"]]
    check = results["norm_check"]
    lines += ["", f"Per-sample norm check (ours vs torch.func, first batch): **{check['result']}**: {check['text']}."]
    if "tiny_norm_check" in results:
        tiny = results["tiny_norm_check"]
        lines += ["", f"Per-sample norm check on a tiny Llama (ours vs torch.func): **{tiny['result']}**: {tiny['text']}."]
    lines += [
        "",
        f"Total wall time {meta['wall_s']:.0f} s; host load average (1/5/15 min) at start "
        + f"{meta['loadavg_start']}, at end {meta['loadavg_end']} (a shared box: compare rows of one run).",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Step time and peak memory bars per method (methods that did not run are labelled)."""
    plt = pyplot()
    rows = results["methods"]
    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key, scale, unit in ((axes[0], "step_s", 1e3, "step time (ms)"), (axes[1], "peak_bytes", 2**-20, "peak memory (MiB)")):
        values = [r[key] * scale if r["status"] == "ok" else 0.0 for r in rows]
        colors = ["tab:gray" if n.startswith("non_private") else "tab:blue" for n in names]
        bars = ax.bar(range(len(rows)), values, color=colors)
        for bar, row in zip(bars, rows, strict=True):
            if row["status"] != "ok":
                text = "skipped" if row["status"].startswith("skipped") else "failed"
                ax.text(bar.get_x() + bar.get_width() / 2, 0, text, ha="center", va="bottom", rotation=90, fontsize=8)
        ax.set_xticks(range(len(rows)), names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(unit)
    fig.suptitle(f"DP training step, {results['meta']['model']} ({results['meta']['device']})", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
