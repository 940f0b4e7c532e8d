"""Canary exposure and validation perplexity of DP fine-tuning a real model (the secret sharer test).

Python's bundled docs split into held-out validation windows and training text holding canaries
``"<person>'s PIN is <digits>."`` (``trainer.canary``); runs ``base`` (no fine-tuning), ``non-private`` and
``dp eps=<e>`` (delta = 1/(2N)), all with ``vllm-dp train``'s code. Metrics: validation perplexity and each
canary's exposure, ``log2 C - log2 rank`` bits among C = 10**digits candidates (chance: mean ~1.44 bits,
P(exposure >= x) = 2**-x). Rewrites ``canary-<model>-<setup>-<device>-<date>.{md,json,png}`` after every
run (docs/training.md).
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from vllm_dp_plugin.benchmarks.lib import cli, report
from vllm_dp_plugin.benchmarks.lib.environment import device_label, environment, loadavg
from vllm_dp_plugin.benchmarks.lib.progress import logger
from vllm_dp_plugin.benchmarks.lib.scenarios import resolve_model
from vllm_dp_plugin.trainer import canary as secret_sharer
from vllm_dp_plugin.trainer.lora import LLAMA_PROJECTIONS, LoraSpec
from vllm_dp_plugin.trainer.train import TrainConfig, make_records, train


def split_documents(docs: Sequence[str], tokenizer, seq_len: int, val_records: int, seed: int):
    """``(train_docs, val_docs)``: shuffled documents, held out until their windows reach
    ``val_records``."""
    order = list(docs)
    random.Random(seed).shuffle(order)
    held, windows = 0, 0
    while windows < val_records and held < len(order) - 1:
        windows += len(make_records([order[held]], tokenizer, seq_len))
        held += 1
    return order[held:], order[:held]


def evaluate(directory, tokenizer, val, canaries) -> dict:
    """The validation perplexity and every canary's exposure of the model in ``directory``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return {"perplexity": secret_sharer.perplexity(model, val),
            "canaries": [secret_sharer.canary_exposure(model, tokenizer, c) for c in canaries]}


def run_config(args, model: str, data: Path, output_dir: Path, epsilon: float | None) -> TrainConfig:
    """The training of one run (``epsilon`` None: non-private)."""
    lora = None if args.full else LoraSpec(r=args.lora_r, alpha=2.0 * args.lora_r, target_modules=args.lora_targets)
    return TrainConfig(model=model, output_dir=str(output_dir), data=str(data), seq_len=args.seq_len,
                       epsilon=epsilon or 1.0, private=epsilon is not None, epochs=args.epochs,
                       batch_size=args.batch_size, max_physical_batch=args.max_physical_batch,
                       learning_rate=args.lr, seed=args.seed, lora=lora, checkpoint_every=10**6)


def run_label(args) -> str:
    """The training setup in the result file names: ``lora8-qv-seq64-e1``, ``full-seq64-e1``."""
    mode = "full" if args.full else f"lora{args.lora_r}" + ("" if args.lora_targets == LLAMA_PROJECTIONS else
                                                           "-" + "".join(t[0] for t in args.lora_targets))
    return f"{mode}-seq{args.seq_len}-e{args.epochs:g}"


def summarize(results: dict) -> None:
    """Per run: gain kept (of the non-private log-perplexity gain), whether every canary is
    consistent with chance at 1% (Bonferroni), and each canary's exposure minus the base model's
    (the base model has priors: a secret that looks like a year ranks high before any training)."""
    base = math.log(results["runs"][0]["perplexity"])
    np_run = next((r for r in results["runs"] if r["name"] == "non-private"), None)
    gain = base - math.log(np_run["perplexity"]) if np_run else None
    m = len(results["runs"][0]["canaries"])
    base_exposure = [c["exposure"] for c in results["runs"][0]["canaries"]]
    for run in results["runs"]:
        run["gain_kept"] = (base - math.log(run["perplexity"])) / gain if gain else None
        run["at_chance"] = all(c["chance_p"] >= 0.01 / m for c in run["canaries"])
        for c, before in zip(run["canaries"], base_exposure, strict=True):
            c["over_base"] = c["exposure"] - before
        run["max_over_base"] = max(c["over_base"] for c in run["canaries"])


def render_markdown(results: dict) -> str:
    """The report: a row per run, then every canary of every run."""
    meta, s, fmt = results["meta"], results["settings"], report.fmt
    reps = sorted({c["repetitions"] for c in results["runs"][0]["canaries"]})
    head = ["run", "epsilon", "val perplexity", "gain kept", *[f"exposure x{k} (bits)" for k in reps],
            "max over base (bits)", "all at chance (1%)"]
    rows = [[run["name"], fmt(run.get("epsilon")) if run.get("epsilon") is not None else "-",
             run["perplexity"], "-" if run["gain_kept"] is None else f"{100 * run['gain_kept']:.0f}%",
             *[", ".join(fmt(c["exposure"], 2) for c in run["canaries"] if c["repetitions"] == k) for k in reps],
             f"{run['max_over_base']:+.2f}", "yes" if run["at_chance"] else "**no**"] for run in results["runs"]]
    canaries = [[run["name"], c["prefix"], c["repetitions"], c["rank"], f"{c['exposure']:.2f}"]
                for run in results["runs"] for c in run["canaries"]]
    return "\n".join([
        f"# Canary exposure of DP fine-tuning: {meta['model']} ({meta['device']}, {meta['date']})", "",
        f"`{meta['command']}`", "",
        (f"{s['mode']}, {s['records']} training records of <= {s['seq_len']} tokens (Python's bundled docs + "
         f"canaries), {s['val_records']} held-out validation windows, batch {s['batch_size']} (Poisson, q = "
         f"{s['sample_rate']:.4f}), {s['steps']} steps, Adam lr {s['lr']}, delta = {s['delta']:.2e} per record. "
         f"Canaries: {s['canaries']} of {s['digits']} digits ({10 ** s['digits']} candidates; exposure <= "
         f"{s['digits'] * math.log2(10):.1f} bits; chance: mean {math.log2(math.e):.2f} bits, P(>= x) = 2^-x), "
         f"each repetition its own record. Wall {meta['wall_s'] / 60:.0f} min, load {meta['loadavg_start']} -> "
         f"{meta['loadavg_end']}."), "",
        report.table(head, rows), "",
        ("Exposure columns list each canary of that repetition count. \"gain kept\": the run's reduction of "
         "validation log-perplexity from the base model, as a fraction of the non-private run's. \"at chance\": "
         f"every canary's rank / {10 ** s['digits']} >= 0.01 / {len(results['runs'][0]['canaries'])} (what a model "
         "that learnt nothing about the secrets passes with probability >= 99%); \"max over base\": the largest "
         "increase of a canary's exposure over the base model's. DP protects one record: a canary repeated k times "
         "is covered by group privacy at k x epsilon."), "",
        report.table(["run", "canary", "repetitions", "rank", "exposure (bits)"], canaries),
    ]) + "\n"


def plot(results: dict, path: Path) -> None:
    """Each run's largest exposure per repetition count, and its validation perplexity."""
    plt = report.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    runs = results["runs"]
    names = [r["name"] for r in runs]
    reps = sorted({c["repetitions"] for c in runs[0]["canaries"]})
    width = 0.8 / len(reps)
    for j, k in enumerate(reps):
        ys = [max(c["exposure"] for c in r["canaries"] if c["repetitions"] == k) for r in runs]
        left.bar([i + j * width for i in range(len(runs))], ys, width, label=f"inserted {k}x (max)")
    left.axhline(math.log2(math.e), color="k", ls="--", lw=1, label="chance (mean)")
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(runs))], names, rotation=20)
    left.set(ylabel="exposure (bits)", title="canary exposure")
    left.legend(fontsize=8)
    right.bar(names, [r["perplexity"] for r in runs], color="tab:gray")
    right.set(ylabel="validation perplexity", title="held-out Python docs")
    right.tick_params(axis="x", rotation=20)
    fig.suptitle(f"{results['meta']['model']}: {results['settings']['mode']}")
    fig.tight_layout()
    report.save_figure(fig, path)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser.add_argument
    p("--model", default="smollm2", help="smollm2 or a Hugging Face Llama directory (default smollm2)")
    p("--epsilons", type=cli.floats, default=(1.0, 4.0, 8.0), help="DP runs' epsilon (default 1,4,8)")
    p("--repetitions", type=cli.ints, default=(1, 4, 16), help="canary insertion counts (default 1,4,16)")
    p("--per-level", type=int, default=2, help="canaries per insertion count (default 2)")
    p("--digits", type=int, default=4, help="digits of a secret (default 4: 10,000 candidates)")
    p("--full", action="store_true", help="full fine-tuning (Phantom Clipping) instead of LoRA")
    p("--lora-r", type=int, default=8, help="LoRA rank (alpha = 2r; default 8)")
    p("--lora-targets", type=cli.names, default=LLAMA_PROJECTIONS,
      help="LoRA target modules (default: all 7 Llama projections)")
    p("--seq-len", type=int, default=64, help="tokens per record (default 64)")
    p("--epochs", type=float, default=1.0, help="epochs (default 1)")
    p("--batch-size", type=int, default=64, help="expected batch (default 64)")
    p("--max-physical-batch", type=int, default=16, help="records per forward (default 16)")
    p("--lr", type=float, default=2e-3, help="Adam learning rate (default 2e-3)")
    p("--val-records", type=int, default=128, help="held-out validation windows (default 128)")
    p("--max-docs", type=int, default=0, help="use only this many documents (0: all; tests)")
    p("--seed", type=int, default=0, help="split, canaries, sampling and noise seed (default 0)")
    p("--work", type=Path, default=None, help="training output directories (default: a temp dir)")
    cli.add_date_arg(cli.add_out_arg(parser))
    p("--quiet", action="store_true", help="no progress")
    return parser


def build_parser() -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog="vllm-dp bench canary", description=__doc__.split("\n\n")[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``vllm-dp bench canary ...``)."""
    from transformers import AutoTokenizer

    from vllm_dp_plugin.demo import public_corpus
    from vllm_dp_plugin.trainer.train import plan_run

    args, argv = cli.parse(args, build_parser)
    args.date, log = cli.today(args.date), logger(not args.quiet)
    try:
        model_name, path = resolve_model(args.model)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    tokenizer = AutoTokenizer.from_pretrained(path)
    docs = public_corpus()[: args.max_docs or None]
    train_docs, val_docs = split_documents(docs, tokenizer, args.seq_len, args.val_records, args.seed)
    val = make_records(val_docs, tokenizer, args.seq_len)
    val = type(val)(*(t[: args.val_records] for t in (val.ids, val.labels, val.mask)))
    canaries = secret_sharer.make_canaries(args.repetitions, args.per_level, args.digits, args.seed)
    start, load_start, label = time.perf_counter(), loadavg(), device_label(torch.device("cpu"))
    stem = Path(args.out) / f"canary-{model_name}-{run_label(args)}-{label}-{args.date}"
    with tempfile.TemporaryDirectory(prefix="vllm-dp-canary-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = work / "train.txt"
        documents = secret_sharer.insert_canaries(train_docs, canaries, args.seed)
        data.write_text("\n\n".join(d.replace("\n\n", "\n") for d in documents))
        records = len(make_records(data.read_text().split("\n\n"), tokenizer, args.seq_len))
        plan = plan_run(run_config(args, path, data, work / "plan", 1.0), records)
        mode = "full fine-tuning" if args.full else f"LoRA r={args.lora_r} on {', '.join(args.lora_targets)}"
        results = {"settings": {"mode": mode, "records": records, "seq_len": args.seq_len, "val_records": len(val),
                                "batch_size": args.batch_size, "sample_rate": plan.sample_rate, "steps": plan.steps,
                                "lr": args.lr, "delta": plan.delta, "epochs": args.epochs, "digits": args.digits,
                                "canaries": len(canaries), "repetitions": list(args.repetitions)}, "runs": []}

        def finish(run: dict) -> None:
            """Add ``run`` and rewrite the result files."""
            results["runs"].append(run)
            log(f"{run['name']}: perplexity {run['perplexity']:.3f}, exposures "
                f"{[round(c['exposure'], 2) for c in run['canaries']]}")
            results["meta"] = {"model": model_name, "device": label, "date": args.date,
                               "command": cli.command_line("vllm-dp bench canary", argv),
                               "env": environment(torch.device("cpu")), "wall_s": time.perf_counter() - start,
                               "loadavg_start": load_start, "loadavg_end": loadavg()}
            summarize(results)
            report.write_json(report.suffixed(stem, ".json"), results)
            report.write_text(report.suffixed(stem, ".md"), render_markdown(results))
            plot(results, report.suffixed(stem, ".png"))

        finish({"name": "base", **evaluate(path, tokenizer, val, canaries)})
        for epsilon in (None, *args.epsilons):
            name = "non-private" if epsilon is None else f"dp eps={epsilon:g}"
            log(f"training {name} ...")
            t0, out = time.perf_counter(), work / name.replace(" ", "_")
            trained = train(run_config(args, path, data, out, epsilon), progress=not args.quiet)
            finish({"name": name, "epsilon": trained["epsilon"], "noise_multiplier": trained.get("noise_multiplier"),
                    "train_s": time.perf_counter() - t0, **evaluate(out / "model", tokenizer, val, canaries)})
    log(f"wrote {stem}.md, .json and .png")
    return 0
