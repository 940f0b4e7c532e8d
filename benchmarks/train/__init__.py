"""``python -m benchmarks.train``: step time and peak memory of DP training (DPFormer's efficiency claims).

One Hugging Face GPT-2 causal LM (``Conv1D`` projections, learned positions, LayerNorm, a 50257
token vocabulary whose output head is tied to the input embedding), one fixed synthetic batch
(seeded uniform token ids, every token a label), one run per method:

* ``non_private``: the mean loss, one backward, Adam;
* ``ours``: ``DPEngine`` (book-keeping: one backward w.r.t. the module outputs, ghost norms,
  Phantom Clipping for the tied embedding, clipped sums, float64 Gaussian noise), Adam;
* ``opacus_ghost``: Opacus 1.6 ghost clipping (``make_private(grad_sample_mode="ghost")``: two
  backwards, ghost norms for Linear and Embedding, per-sample gradients for the layers it has
  no norm rule for: LayerNorm by its own rule, Hugging Face Conv1D through ``torch.func``) on
  the same tied model;
* ``opacus_ghost_untied``: the same with an untied output head (``nn.Linear``), the model Opacus
  can run (a sane baseline: expect parity, not the paper's 100x, which fits a ghost-clipping
  baseline whose untied output layer is an embedding lookup of all M items);
* ``naive_vmap``: per-sample gradients ``vmap(grad(loss))``, clipped, summed, noised, Adam;
  skipped when ``B * P`` float32 per-sample gradients (x ``NAIVE_COPIES``) exceed half the free
  memory.

All DP methods clip flat (Abadi, ``min(1, C / n_i)``, as Opacus does) with noise multiplier
``--noise-multiplier`` and add the noise in every step. Step time: the median of ``--steps``
timed steps after ``--warmup`` untimed ones (the device synchronised around each step); the
batch is fixed (no Poisson sampling, which would change the work per step).

Peak memory, comparable across methods, devices and suites (``benchmarks.lib.measure.PeakMemory``):
parameters + the most the method's set-up and steps allocate above what was in use once the
model and batch existed (gradients, optimiser states, activations, per-sample state). CUDA:
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. CPU: the process's
resident-set high-water mark (``VmHWM``), reset through ``/proc/self/clear_refs`` (after
``malloc_trim``) before the method is built; torch's CPU allocations are invisible to
``tracemalloc``, and the profiler's memory view slows the steps it measures. Each method runs
in its own process forked from a clean server process (``multiprocessing`` forkserver that has
only imported the libraries), so one method's freed-but-cached memory, allocator state or CUDA
context never counts for the next. Without ``clear_refs`` the CPU peak falls back to
``ru_maxrss`` (not resettable: an upper bound that may include set-up peaks; the JSON says
which).

Also checks that our per-sample gradient norms equal the ``torch.func`` ones on the first batch
(same initial weights, float32: relative tolerance ``NORM_RTOL``).

A real model (``--model smollm2``: SmolLM2-135M-Instruct, ``.models/smollm2-135m-instruct``,
imported on first use; or any Hugging Face Llama directory) replaces the GPT-2 preset: its
pretrained float32 weights (tied 49,152-token embedding for SmolLM2; ``opacus_ghost_untied``
gets an untied copy of the output head), or seeded random ones for a directory holding only a
``config.json`` (``benchmarks.lib.models.load_causal_lm``: SmolLM2's architecture carried to a GPU machine
its weights cannot reach; step time and memory do not depend on the values), a seeded batch of
uniform token ids from its vocabulary with ``position_ids [B, T]`` (default 32 x 128 on CPU,
32 x 512 on CUDA), and three LoRA rows (``peft`` adapters from ``trainer.lora``, default r 8,
alpha 16 on all 7 Llama projections; only the adapters trained, Adam on them):

* ``non_private_lora``: the mean loss, one backward, Adam;
* ``ours_lora``: ``DPEngine`` over the peft model (the adapters' ``lora_A``/``lora_B`` are plain
  ``nn.Linear``: the engine's Linear rule; the frozen base is not hooked);
* ``opacus_lora``: Opacus 1.6 ``make_private(grad_sample_mode="ghost")`` over the peft model;
  where ghost clipping refuses (at ``make_private`` or in the first step) the default hooks mode
  (per-sample gradients of the adapters) runs instead and the row's label says so.

LoRA rows compare with ``non_private_lora``, the others with ``non_private``; the targets for a
real model are tighter (``MODEL_TARGET_*``, ``LORA_TARGET_RATIO``; full fine-tuning's time bound
is 1.25x on CPU, 1.2x on CUDA). ``naive_vmap`` keeps its
memory rule (SmolLM2 at 32 x 128 needs ~48 GiB of per-sample gradients: skipped on most hosts);
the norm check then runs on a tiny random 2-layer Llama of the model's shape (vocabulary cut to
``TINY_VOCAB``), full fine-tuning (tied: Phantom Clipping) and LoRA (``lora_B`` drawn at random
so both factors have gradients), in the main process.

Writes ``train-[<model>-]<device>[-bf16]-<date>.{md,json,png}`` into ``--out`` (``<model>``:
``smollm2`` or the directory's name). Run as ``python -m benchmarks.train``
(``--quick``: a toy model, seconds).

The suite is a package: ``spec`` (sizes, ``BenchSpec``, model and batch), ``methods``
(``METHODS``: the training steps), ``measure`` (one method in its own process), ``verdicts``
(ratios, targets, norm checks), ``report`` (markdown, plot) and here ``add_cli_args`` and
``main``.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks import with_example
from benchmarks.lib.measure import usable_device
from benchmarks.lib.models import has_weights
from benchmarks.train.measure import run_isolated
from benchmarks.train.methods import METHODS, PRESET_METHODS
from benchmarks.train.report import _mib, plot, render_markdown
from benchmarks.train.spec import PRESETS, BenchSpec, ModelSize
from benchmarks.train.verdicts import (
    add_ratios,
    norm_check,
    targets,
    tiny_llama_norm_check,
)
from vllm_dp_plugin.benchmarks.lib.cli import (
    add_date_arg,
    add_device_arg,
    add_out_arg,
    add_quick_arg,
    parse,
    today,
)
from vllm_dp_plugin.benchmarks.lib.environment import (
    default_device,
    device_label,
    environment,
    loadavg,
)
from vllm_dp_plugin.benchmarks.lib.progress import logger
from vllm_dp_plugin.benchmarks.lib.report import suffixed, write_json, write_text
from vllm_dp_plugin.benchmarks.lib.scenarios import resolve_model
from vllm_dp_plugin.trainer.lora import LoraSpec

MODEL_BATCH = {"cpu": (32, 128), "cuda": (32, 512)}  # --model default (batch, seq len) by device type
QUICK_MODEL_BATCH = (2, 16)  # --model with --quick
PRELOAD = ["benchmarks.train", "transformers.models.gpt2.modeling_gpt2", "opacus"]
MODEL_PRELOAD = ["transformers.models.llama.modeling_llama", "peft"]


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    add_device_arg(p, default_device(), "cpu or cuda[:i]")
    add_out_arg(p)
    add_quick_arg(p, "toy model, 1 + 2 steps (seconds; for tests); with --model: batch 2 x 16")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: gpt2-small on CUDA, tiny on CPU)")
    p.add_argument(
        "--model", default="",
        help="a real model instead of a preset: 'smollm2' (SmolLM2-135M-Instruct, .models/smollm2-135m-instruct, "
        "imported on first use) or a Hugging Face Llama directory; pretrained float32 weights, adds the LoRA rows "
        f"(default batch {MODEL_BATCH['cpu'][0]} x {MODEL_BATCH['cpu'][1]} on CPU, "
        f"{MODEL_BATCH['cuda'][0]} x {MODEL_BATCH['cuda'][1]} on CUDA)",
    )
    p.add_argument("--batch", type=int, help="override the preset's (or --model's default) batch size")
    p.add_argument("--seq-len", type=int, help="override the preset's (or --model's default) sequence length")
    p.add_argument("--autocast", choices=("none", "bf16"), default="none", help="forward + loss under bf16 autocast")
    p.add_argument(
        "--methods",
        help=f"comma list of {', '.join(METHODS)} (default: all; without --model those without LoRA)",
    )
    p.add_argument("--lora-r", type=int, default=LoraSpec.r, help=f"LoRA rank (default {LoraSpec.r})")
    p.add_argument("--lora-alpha", type=float, default=LoraSpec.alpha, help=f"LoRA alpha (default {LoraSpec.alpha:g})")
    p.add_argument("--warmup", type=int, help="untimed steps (default 1 on CPU, 3 on CUDA)")
    p.add_argument("--steps", type=int, help="timed steps (default 5 on CPU, 10 on CUDA; quick 2)")
    p.add_argument("--noise-multiplier", type=float, default=1.0, help="DP noise multiplier (default 1)")
    p.add_argument("--clip-norm", type=float, default=1.0, help="per-sample clipping norm C (default 1)")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate (default 1e-4)")
    p.add_argument("--seed", type=int, default=0, help="weights, data and noise seed (default 0)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per method before it is an error row")
    add_date_arg(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


@with_example
def build_parser(prog: str = "python -m benchmarks.train") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(
        prog=prog,
        description="DP training step time and peak memory: non-private, ours, Opacus ghost clipping, torch.func; "
        "with --model (e.g. smollm2) full and LoRA fine-tuning of a real model.",
    ))


def _model_size(path: str, batch: int, seq_len: int) -> ModelSize:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    tied = "tied" if getattr(config, "tie_word_embeddings", False) else "untied"
    weights = "pretrained" if has_weights(path) else "random weights"
    return ModelSize(
        vocab=config.vocab_size, n_embd=config.hidden_size, n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads, seq_len=seq_len, batch=batch,
        family=f"{Path(path).name} ({config.model_type}, {tied} embeddings, {weights})",
    )


def _spec_from_args(args: argparse.Namespace, model: str = "") -> BenchSpec:
    """Preset (or ``model``'s directory), overrides and per-device step counts; ValueError for
    bad sizes or methods."""
    cuda = torch.device(args.device).type == "cuda"
    if model:
        if args.preset:
            raise ValueError("--model and --preset exclude each other")
        batch, seq_len = QUICK_MODEL_BATCH if args.quick else MODEL_BATCH["cuda" if cuda else "cpu"]
        size = _model_size(model, batch, seq_len)
    else:
        size = PRESETS["toy" if args.quick else args.preset or ("gpt2-small" if cuda else "tiny")]
    size = dataclasses.replace(
        size,
        batch=size.batch if args.batch is None else args.batch,
        seq_len=size.seq_len if args.seq_len is None else args.seq_len,
    )
    if size.batch < 1 or size.seq_len < 2:
        raise ValueError(f"need batch >= 1 and seq-len >= 2, got {size.batch} and {size.seq_len}")
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    steps = args.steps if args.steps is not None else (2 if args.quick else 10 if cuda else 5)
    if warmup < 0 or steps < 1:
        raise ValueError(f"need --warmup >= 0 and --steps >= 1, got {warmup} and {steps}")
    return BenchSpec(
        size=size, device=args.device, autocast=args.autocast, warmup=warmup, steps=steps, seed=args.seed,
        noise_multiplier=args.noise_multiplier, clip_norm=args.clip_norm, lr=args.lr,
        model=model, lora=LoraSpec(r=args.lora_r, alpha=args.lora_alpha),
    )


def _methods_from_args(text: str | None, real_model: bool = False) -> list[str]:
    if text is None:
        return list(METHODS) if real_model else PRESET_METHODS
    names = [m for m in text.split(",") if m]
    unknown = sorted(set(names) - set(METHODS))
    if unknown or not names:
        raise ValueError(f"unknown or no methods {unknown}; choose from {', '.join(METHODS)}")
    lora = [m for m in names if METHODS[m].lora]
    if lora and not real_model:
        raise ValueError(f"{', '.join(lora)} need --model (LoRA adapts a Llama's nn.Linear projections)")
    return names


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``python -m benchmarks.train ...``)."""
    args, argv = parse(args, build_parser)
    device = usable_device(args.device)
    try:
        model_name, model = resolve_model(args.model) if args.model else ("", "")
        spec, names = _spec_from_args(args, model), _methods_from_args(args.methods, bool(model))
    except ValueError as err:
        raise SystemExit(str(err)) from None
    date = today(args.date)
    log = logger(not args.quiet)
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD + (MODEL_PRELOAD if model else []))

    load_start, start = loadavg(), time.perf_counter()
    log(f"== {spec.size.describe()} on {args.device}, autocast {spec.autocast}")
    rows = []
    for name in names:
        row = run_isolated(name, spec, args.timeout)
        rows.append(row)
        log(f"  {name}: " + (f"{row['step_s'] * 1e3:,.0f} ms/step, peak {_mib(row['peak_bytes'])} MiB"
                             if row["status"] == "ok" else row["status"]))
    add_ratios(rows)
    ok = [r for r in rows if r["status"] == "ok"]
    results = {
        "methods": rows,
        "targets": targets(rows, real_model=bool(model), device_type=device.type),
        "norm_check": norm_check(rows, spec.autocast),
        **({"tiny_norm_check": tiny_llama_norm_check(spec)} if model else {}),
        "meta": {
            "device": device_label(device, short=device.type != "cuda"),  # cpu | nvidia-h200
            "date": date,
            "command": " ".join(["python -m benchmarks.train", *(argv or [])]),
            "env": environment(device, packages=("transformers", "opacus") + (("peft",) if model else ())),
            "model": spec.size.describe(),
            "parameters": next((r["parameters"] for r in rows if "parameters" in r and r["tied"] and not r["lora"]), None),
            "lora_parameters": next((r["parameters"] for r in rows if "parameters" in r and r["lora"]), None),
            **{k: v for k, v in dataclasses.asdict(spec).items() if k not in ("size", "model")},
            "model_path": model,
            "random_weights": bool(model) and not has_weights(model),
            "model_name": model_name,
            "size": dataclasses.asdict(spec.size),
            "memory_measure": ok[0]["memory_measure"] if ok else "-",
            "wall_s": time.perf_counter() - start,
            "loadavg_start": load_start,
            "loadavg_end": loadavg(),
        },
    }
    suffix = "-bf16" if spec.autocast == "bf16" else ""
    prefix = f"train-{model_name}-" if model_name else "train-"
    stem = Path(args.out) / f"{prefix}{results['meta']['device']}{suffix}-{date}"
    write_json(suffixed(stem, ".json"), results, indent=2, newline=True)
    write_text(suffixed(stem, ".md"), render_markdown(results))
    plot(results, suffixed(stem, ".png"))
    log(f"norm check: {results['norm_check']['result']}: {results['norm_check']['text']}")
    if model:
        log(f"tiny-Llama norm check: {results['tiny_norm_check']['result']}: {results['tiny_norm_check']['text']}")
    for t in results["targets"]:
        log(f"  {t['result']}: {t['target']} ({t['measured']}; {results['meta']['device']}, autocast {spec.autocast})")
    log(f"wrote {stem}.md, .json and .png")
    return 0
