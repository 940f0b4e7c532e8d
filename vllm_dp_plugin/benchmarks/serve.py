"""``vllm-dp bench serve``: serving throughput and latency with the plugin, through vLLM's own
``vllm bench throughput`` and ``vllm bench serve``.

Rows ``stock``, ``plugin_off`` (plugin loaded, DP off) and ``dp_state`` / ``dp_tree`` (a P-token private
context), each request P + S prompt tokens. Targets: ``plugin_off`` >= 0.97x stock requests/s, ``dp_state``
at P = 2048 >= 0.8x stock output tokens/s. Writes ``serve-cpu-<date>.{md,json,png}``; docs/private-context.md
describes the rows, the steady state (``benchmarks.steady``) and the latency part.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib import report
from vllm_dp_plugin.benchmarks.lib import vllm as vllm_lib
from vllm_dp_plugin.benchmarks.lib.cli import add_out_arg, add_quick_arg, command_line, parse, today
from vllm_dp_plugin.benchmarks.lib.environment import device_label
from vllm_dp_plugin.serving.memory import kv_cache_args

# config -> (the P it is held to, None: every P; the ratio to stock; the target; a verdict's words)
TARGETS = {"plugin_off": (None, "requests_vs_stock", 0.97, "plugin loaded, DP off", "requests/s"),
           "dp_state": (2048, "decode_vs_stock", 0.8, "DP state", "output tokens/s")}
QUICK = {"prefix_lens": (64,), "suffix_len": 16, "output_len": 8, "num_prompts": 4, "latency": False,
         "steady_rounds": 1}  # --quick: a smoke run


@dataclass(frozen=True)
class Settings:
    model: str
    out: Path
    prefix_lens: tuple[int, ...] = (512, 2048)
    suffix_len: int = 64
    output_len: int = 64
    num_prompts: int = 64
    concurrencies: tuple[int, ...] = (1, 8)
    serve_prompts: int = 32
    configs: tuple[str, ...] = ("stock", "plugin_off", "dp_state", "dp_tree")
    latency: bool = True
    epsilon: float = 8.0
    degree: int | None = 2  # Taylor degree of dp_state (None: the kernel_error rule)
    repeats: int = 1  # runs per row, interleaved across configs; the median is reported
    steady_rounds: int = 3  # steady-state rounds per engine (benchmarks.steady); 0: skip


@dataclass
class ThroughputRow:
    config: str
    prefix_len: int
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    elapsed_s: float
    runs: tuple[float, ...] = ()  # requests/s of every run (median row) or empty (one run)


def median_rows(runs: list[ThroughputRow]) -> list[ThroughputRow]:
    """One row per (config, P): its run of median requests/s (the lower one), every run's in ``runs``."""
    groups: dict[tuple[str, int], list[ThroughputRow]] = {}
    for r in runs:
        groups.setdefault((r.config, r.prefix_len), []).append(r)
    return [replace(sorted(group, key=lambda r: r.requests_per_s)[(len(group) - 1) // 2],
                    runs=tuple(r.requests_per_s for r in group)) for group in groups.values()]


@dataclass
class SteadyRow:
    """Best of ``rounds`` identical batches in one engine (``vllm_dp_plugin.benchmarks.steady``)."""

    config: str
    prefix_len: int
    requests_per_s: float  # best round
    output_tokens_per_s: float  # best round
    cpu_s_per_request: float  # process CPU seconds per request, best round (robust to steal)
    wall_s: tuple[float, ...]  # every round


def context_file(s: Settings, prefix_len: int, work: Path) -> Path:
    """``work/context-P.txt``, written once: public text (pydoc pages) cut to ~P tokens, BOS included."""
    path = work / f"context-{prefix_len}.txt"
    if path.exists():
        return path
    from transformers import AutoTokenizer

    from vllm_dp_plugin.demo import public_corpus
    from vllm_dp_plugin.serving.context import tokenize_context

    tokenizer = AutoTokenizer.from_pretrained(s.model)
    text = tokenizer.decode(tokenizer.encode(" ".join(public_corpus()), add_special_tokens=False)[: prefix_len - 1])
    while len(tokenize_context(text, tokenizer)) > prefix_len:  # re-tokenisation may merge differently
        text = text[:-20]
    path.write_text(text)
    return path


def dp_config(mode: str, context: Path, calibration: Path, key: Path, s: Settings) -> dict:
    """The ``dp_privacy`` section of a DP row (``mode``: state or tree)."""
    attention = {"mode": mode, "epsilon": s.epsilon, "delta": 1e-6, "calibration": str(calibration),
                 "private_context": str(context), "gate": False}  # the cost of reading every release
    degree = 1 if mode == "tree" else s.degree  # tree: r = d + 1 features keep the table small
    if degree is not None:
        attention["degree"] = degree
    return {"dp_privacy": {"key_file": str(key), "attention": attention}}


def kernel_errors(s: Settings, calibration: Path) -> list[float]:
    """The guaranteed relative kernel error of dp_state's Taylor map, per layer (public)."""
    from vllm_dp_plugin.config import DPPrivacyConfig
    from vllm_dp_plugin.plan import ContextPlan, ModelShape

    cfg = DPPrivacyConfig.from_dict(dp_config("state", Path("-"), calibration, Path("-"), s)["dp_privacy"]).attention
    plan = ContextPlan.of(cfg, ModelShape.from_pretrained(s.model), "self_attention", 1)
    return [plan.kernel_error(i) for i in range(plan.layers)]


def config_flags(config: str, prefix_len: int, work: Path, s: Settings) -> list[str]:
    """Engine flags of one row: the private context for DP rows, nothing extra otherwise."""
    if not config.startswith("dp_"):
        return []
    cfg = dp_config(config[3:], context_file(s, prefix_len, work), work / "calibration.json", work / "noise.key", s)
    return ["--tokenizer-mode", "dp_private", "--additional-config", json.dumps(cfg)]


def dataset_flags(config: str, prefix_len: int, s: Settings) -> list[str]:
    """Plain prefix for stock/plugin_off; the suffix alone for DP (the renderer adds P tokens)."""
    if config.startswith("dp_"):
        return ["--dataset-name", "random", "--random-input-len", str(s.suffix_len),
                "--random-output-len", str(s.output_len), "--random-range-ratio", "0"]
    return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix_len),
            "--prefix-repetition-suffix-len", str(s.suffix_len), "--prefix-repetition-num-prefixes", "1",
            "--prefix-repetition-output-len", str(s.output_len)]


def throughput_row(config: str, prefix_len: int, s: Settings, work: Path) -> ThroughputRow:
    """One ``vllm bench throughput`` run in a fresh process."""
    result = work / f"throughput-{config}-{prefix_len}.json"
    tokens = prefix_len + s.suffix_len + s.output_len  # every prompt in flight at once
    cmd = [*vllm_lib.LAUNCH, "bench", "throughput", "--model", s.model,
           *vllm_lib.engine_flags(s.model, s.num_prompts, tokens), "--num-prompts", str(s.num_prompts),
           "--output-json", str(result), *dataset_flags(config, prefix_len, s),
           *config_flags(config, prefix_len, work, s)]
    vllm_lib.run_logged(cmd, vllm_lib.config_env(config), work / f"throughput-{config}-{prefix_len}.log")
    data = json.loads(result.read_text())
    elapsed = data["elapsed_time"]
    return ThroughputRow(config, prefix_len, data["requests_per_second"],
                         data["num_requests"] * s.output_len / elapsed, data["tokens_per_second"], elapsed)


def steady_row(config: str, prefix_len: int, s: Settings, work: Path) -> SteadyRow:
    """One engine (``benchmarks.steady``), ``s.steady_rounds`` rounds of the throughput row's requests."""
    from transformers import AutoTokenizer

    from vllm_dp_plugin.serving.context import tokenize_context

    tokenizer = AutoTokenizer.from_pretrained(s.model)
    flags = config_flags(config, prefix_len, work, s)
    length, tokens = vllm_lib.MAX_MODEL_LEN, prefix_len + s.suffix_len + s.output_len
    llm = {"model": s.model, "dtype": "float32", "block_size": 32, "enforce_eager": True, "max_model_len": length,
           "seed": 0, **kv_cache_args(s.model, length, s.num_prompts, tokens=tokens)}
    if flags:
        llm.update(tokenizer_mode="dp_private", additional_config=json.loads(flags[-1]))
    prefix = [] if flags else tokenize_context(context_file(s, prefix_len, work).read_text(), tokenizer)
    job = {"llm": llm, "prefix_ids": prefix, "suffix_len": s.suffix_len, "output_len": s.output_len,
           "num_prompts": s.num_prompts, "rounds": s.steady_rounds, "seed": 0, "vocab_size": len(tokenizer)}
    log = work / f"steady-{config}-{prefix_len}.log"
    vllm_lib.run_logged([sys.executable, "-m", "vllm_dp_plugin.benchmarks.steady", json.dumps(job)],
                        vllm_lib.config_env(config), log)
    (line,) = [x for x in log.read_text().splitlines() if x.startswith("RESULT ")]
    rounds = json.loads(line[len("RESULT "):])
    best = min(rounds, key=lambda r: r["wall_s"])
    return SteadyRow(config, prefix_len, s.num_prompts / best["wall_s"],
                     s.num_prompts * s.output_len / best["wall_s"], best["cpu_s"] / s.num_prompts,
                     tuple(r["wall_s"] for r in rounds))


def ratios(rows: list[ThroughputRow] | list[SteadyRow]) -> list[dict]:
    """Each row against stock at the same P: requests/s and output tokens/s."""
    stock = {r.prefix_len: r for r in rows if r.config == "stock"}
    return [{"config": r.config, "prefix_len": r.prefix_len,
             "requests_vs_stock": r.requests_per_s / stock[r.prefix_len].requests_per_s,
             "decode_vs_stock": r.output_tokens_per_s / stock[r.prefix_len].output_tokens_per_s}
            for r in rows if r.prefix_len in stock]


def verdicts(rel: list[dict]) -> list[str]:
    """PASS or FAIL of every ratio (``ratios``) that ``TARGETS`` bounds."""
    return [f"{what}, P={r['prefix_len']}: {r[key]:.3f}x stock {unit} (target >= {target}): "
            f"{'PASS' if r[key] >= target else 'FAIL'}"
            for r in rel if r["config"] in TARGETS
            for p, key, target, what, unit in [TARGETS[r["config"]]] if p in (None, r["prefix_len"])]


def markdown(s: Settings, rows: list[ThroughputRow], steady: list[SteadyRow], latency: list[dict],
             meta: dict) -> str:
    """The report: throughput, steady-state and latency tables with the targets' verdicts."""

    def vs(rows, key):  # each row's ratio to stock at its P as 0.000 (nan without a stock row)
        rel = {(q["config"], q["prefix_len"]): q[key] for q in ratios(rows)}
        return [f"{rel.get((r.config, r.prefix_len), float('nan')):.3f}" for r in rows]

    degree = "the kernel_error rule" if s.degree is None else str(s.degree)
    errors = meta.get("dp_state_kernel_error") or []
    intro = (f"Command: `{meta['command']}`. Model: `{s.model}` (tiny random Llama, float32). Each row is the "
             f"median of {s.repeats} `vllm bench throughput` run(s) ({s.num_prompts} prompts, suffix "
             f"{s.suffix_len} + output {s.output_len} tokens), each in a fresh process, runs of all rows "
             f"interleaved; DP rows use a private context of P tokens and eps = {s.epsilon} for the whole model. "
             f"dp_state: Taylor degree {degree}, guaranteed relative kernel error per layer "
             f"{', '.join(f'{e:.3f}' for e in errors) or 'n/a'}; dp_tree: degree 1. Timings on this shared 2-core "
             "VM vary run to run (2x seen); the req/s of every run are listed.")
    head = ["config", "P", "requests/s", "output tok/s", "total tok/s", "vs stock (req/s)", "vs stock (decode)",
            "req/s of each run"]
    body = [[r.config, r.prefix_len, f"{r.requests_per_s:.2f}", f"{r.output_tokens_per_s:.1f}",
             f"{r.total_tokens_per_s:.1f}", requests, decode, ", ".join(f"{x:.2f}" for x in r.runs)]
            for r, requests, decode in zip(rows, vs(rows, "requests_vs_stock"), vs(rows, "decode_vs_stock"))]
    lines = [f"# vllm-dp bench serve ({meta['device']}, {meta['date']})", "", intro, "", "## Throughput", "",
             report.table(head, body), "", "Targets (`vllm bench throughput`):", "",
             *[f"- {v}" for v in verdicts(ratios(rows))]]
    if steady:
        head = ["config", "P", "requests/s", "output tok/s", "vs stock (decode)", "CPU ms / request",
                "wall s of each round"]
        body = [[r.config, r.prefix_len, f"{r.requests_per_s:.2f}", f"{r.output_tokens_per_s:.1f}", decode,
                 f"{1e3 * r.cpu_s_per_request:.1f}", ", ".join(f"{w:.2f}" for w in r.wall_s)]
                for r, decode in zip(steady, vs(steady, "decode_vs_stock"))]
        lines += ["", (f"## Steady state: best of {s.steady_rounds} rounds in one engine "
                       "(`vllm_dp_plugin.benchmarks.steady`)"), "",
                  (f"Same workload, one engine per row, the batch generated once to warm up then {s.steady_rounds} "
                   "times; the best round is reported (this VM's CPU steal, 10-50% at times, inflates single "
                   "runs), with process CPU seconds per request (steal is not charged as CPU time)."), "",
                  report.table(head, body), "", "Targets (steady state):", "",
                  *[f"- {v}" for v in verdicts(ratios(steady))]]
    if latency:
        head = ["config", "P", "concurrency", "mean TTFT ms", "p99 TTFT ms", "mean TPOT ms", "p99 TPOT ms", "req/s"]
        body = [[r["config"], r["prefix_len"], r["concurrency"], f"{r['mean_ttft_ms']:.1f}",
                 f"{r['p99_ttft_ms']:.1f}", f"{r['mean_tpot_ms']:.2f}", f"{r['p99_tpot_ms']:.2f}",
                 f"{r['request_throughput']:.2f}"] for r in latency]
        lines += ["", "## Latency (`vllm bench serve`, /v1/completions)", "", report.table(head, body)]
    return "\n".join(lines) + "\n"


def plot(panels: dict[str, list], path: Path) -> None:
    """Output tokens/s relative to stock, one group of bars per P, one panel per measurement."""
    plt = report.pyplot()
    panels = {title: ratios(rows) for title, rows in panels.items() if rows}
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.5), squeeze=False)
    for ax, (title, rel) in zip(axes[0], panels.items(), strict=True):
        prefixes = sorted({r["prefix_len"] for r in rel})
        configs = [c for c in ("plugin_off", "dp_state", "dp_tree") if any(r["config"] == c for r in rel)]
        width = 0.8 / max(1, len(configs))
        for i, config in enumerate(configs):
            values = [next((r["decode_vs_stock"] for r in rel if r["config"] == config and r["prefix_len"] == p),
                           0.0) for p in prefixes]
            ax.bar([j + i * width for j in range(len(prefixes))], values, width, label=config)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(TARGETS["dp_state"][2], color="red", ls="--", lw=0.8, label="DP target 0.8x")
        ax.set_xticks([j + width * (len(configs) - 1) / 2 for j in range(len(prefixes))],
                      [f"P={p}" for p in prefixes])
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("output tokens/s vs stock")
        ax.legend(fontsize=8)
    fig.tight_layout()
    report.save_figure(fig, path, dpi=120)


def prepare(s: Settings, work: Path) -> None:
    """Demo model (if the default path is missing) and the public calibration file."""
    if not (Path(s.model) / "config.json").exists():
        from vllm_dp_plugin.demo import make_demo_llama

        make_demo_llama(s.model)
    if any(c.startswith("dp_") for c in s.configs):
        from vllm_dp_plugin.calibration import calibrate_model

        calibrate_model(s.model, work / "calibration.json")


def run(s: Settings, argv: Sequence[str]) -> None:
    """Every row of ``s``, then the result files (printed: the markdown)."""
    from tqdm import tqdm

    work = Path(tempfile.mkdtemp(prefix="vllm-dp-bench-serve-"))
    prepare(s, work)
    jobs = [(c, p) for _ in range(s.repeats) for p in s.prefix_lens for c in s.configs]  # interleaved
    rows = median_rows([throughput_row(c, p, s, work) for c, p in tqdm(jobs, desc="bench throughput", unit="run")])
    steady, latency, longest = [], [], max(s.prefix_lens)
    if s.steady_rounds:
        jobs = [(c, p) for p in s.prefix_lens for c in s.configs]
        steady = [steady_row(c, p, s, work) for c, p in tqdm(jobs, desc="steady state", unit="engine")]
    if s.latency:
        for config in tqdm(("stock", "dp_state"), desc="bench serve", unit="server"):
            latency += vllm_lib.served_latency(
                config, s.model, config_flags(config, longest, work, s), vllm_lib.config_env(config),
                dataset_flags(config, longest, s), s.concurrencies, s.serve_prompts, work, {"prefix_len": longest})
    date = today()
    meta = {"date": date, "device": device_label("cpu"), "platform": platform.platform(),
            "command": command_line("vllm-dp bench serve", argv, quote=False), "work_dir": str(work),
            "dp_state_kernel_error": kernel_errors(s, work / "calibration.json")
            if "dp_state" in s.configs else None}
    stem = s.out / f"serve-cpu-{date}"
    result = {"meta": meta, "settings": {**asdict(s), "out": str(s.out)}, "throughput": [asdict(r) for r in rows],
              "relative": ratios(rows), "steady": [asdict(r) for r in steady], "steady_relative": ratios(steady),
              "latency": latency, "verdicts": verdicts(ratios(rows)), "steady_verdicts": verdicts(ratios(steady))}
    report.write_json(report.suffixed(stem, ".json"), result, indent=1)
    report.write_text(report.suffixed(stem, ".md"), markdown(s, rows, steady, latency, meta))
    plot({"vllm bench throughput": rows, f"steady state (best of {s.steady_rounds})": steady},
         report.suffixed(stem, ".png"))
    print(report.suffixed(stem, ".md").read_text())


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=".demo/llama", help="model dir (demo Llama built if missing)")
    add_out_arg(parser)
    parser.add_argument("--prefix-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--configs", nargs="+", default=["stock", "plugin_off", "dp_state", "dp_tree"])
    parser.add_argument("--degree", default="2", help="Taylor degree of dp_state, or 'auto' for the "
                        "kernel_error rule (default 2: what head_dim >= 64 models get by default)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per row, interleaved; median reported")
    parser.add_argument("--steady-rounds", type=int, default=3, help="rounds per steady-state engine (0: skip)")
    parser.add_argument("--no-latency", action="store_true", help="skip the vllm bench serve part")
    return add_quick_arg(parser, "smoke run: P=64, 4 prompts, no latency")


def build_parser() -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog="vllm-dp bench serve", description=__doc__.splitlines()[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``vllm-dp bench serve ...``)."""
    args, argv = parse(args, build_parser)
    options = QUICK if args.quick else {
        "prefix_lens": tuple(args.prefix_lens), "num_prompts": args.num_prompts, "output_len": args.output_len,
        "latency": not args.no_latency, "degree": None if args.degree == "auto" else int(args.degree),
        "repeats": args.repeats, "steady_rounds": args.steady_rounds}
    run(Settings(model=args.model, out=args.out, configs=tuple(args.configs), **options), argv or [])
    return 0
