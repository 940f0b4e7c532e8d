"""Research and reproduction suites of vllm-dp: what decided a design question or reproduces a
paper's number. They live in the repository, not in the installed package; the package keeps the
suites a user runs against their own deployment (``vllm-dp bench SUITE``,
``vllm_dp_plugin/benchmarks/``).

Run one from the repository root as ``python -m benchmarks.SUITE [options]`` (``--help`` ends with
a worked example). Each suite is a module or a package with ``add_cli_args(parser)``,
``build_parser()`` and ``main(args)``, imports the shared lib (``vllm_dp_plugin.benchmarks.lib``,
and ``benchmarks.lib`` for what only research suites need: timing and peak memory, the scenario
generator, the prompt-search helpers) and the package proper, never another suite. Results go to
``benchmarks/results/`` like the package suites'.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

from vllm_dp_plugin.benchmarks.lib.cli import ExampleHelpFormatter, example

SUITES = {  # module -> (what it measures, its worked example's options)
    "attention": ("DP cross-attention (state, tree) vs exact attention: accuracy, real heads, speed",
                  "--quick --out /tmp/bench-attention"),
    "attention_real": ("why DP attention garbles a real chat model, offline: sinks, kernel error, noise, per layer",
                       "--quick --out /tmp/bench-attention-real"),
    "attention_ladder": ("can a bounded kernel carry a real model's private context? the noise-free ladder, offline",
                         "--limit 1 --sizes '' --modes full,block,clustered64 --out /tmp/bench-ladder"),
    "decode_step": ("DP attention's serving path for one decode step, engine-free: CPU ms and profile",
                    "--quick --out /tmp/bench-decode-step"),
    "whisper": ("Whisper tiny.en word error rate vs eps with DP cross-attention (stock, dp_off, state, tree)",
                "--quick --out /tmp/bench-whisper"),
    "aggregate_batch": ("answer-level aggregation: k member prompts batched vs one plain request (transformers)",
                        "--quick --out /tmp/bench-aggregate-batch"),
    "context_speed": ("DP aggregation speed: time per output token, seconds per answer vs collection size, answers/s",
                      "--rows aggregate_extract --eps 4 --out /tmp/bench-context-speed"),
    "make_scenarios": ("generated private-context scenarios: the bundled set (seed 0) and held-out sets",
                       "/tmp/heldout.jsonl --count 12 --seed 101"),
    "ledger_jsonl": ("budget ledger speed with the JSONL + flock ledger SQLite replaced (from a git revision)",
                     "--quick --backends sqlite,jsonl --out /tmp/bench-ledger-jsonl"),
    "workload": ("make serve's collection, a mixed stream of 1,000 questions: per-document vs per-collection budgets",
                 "--questions 100 --out /tmp/bench-workload"),
    "prompt": ("prompt privatization: token preservation and sentence cosine vs eps, true delta",
               "--quick --out /tmp/bench-prompt"),
    "prompt_ttft": ("prompt privatization: overhead on vLLM time to first token",
                    "--model .models/smollm2-135m-instruct --quick --out /tmp/bench-ttft"),
    "prompt_speed": ("prompt privatization: privatized tokens/s (nearest candidate, privatizer)",
                     "--quick --out /tmp/bench-prompt-speed"),
    "dpformer": ("DPFormer reproduction: NDCG@10/HIT@10 vs eps with and without Re-Attention",
                 "--quick --out /tmp/bench-dpformer"),
    "train": ("DP training step time, peak memory vs non-private, Opacus, torch.func (--model smollm2: +LoRA)",
              "--quick --out /tmp/bench-train"),
}
PREFIX = "python -m benchmarks."


def command(module: str) -> str:
    """The worked example of suite ``module``."""
    return f"{PREFIX}{module} {SUITES[module][1]}"


def with_example(build_parser: Callable[..., argparse.ArgumentParser]) -> Callable[..., argparse.ArgumentParser]:
    """Decorates a suite's ``build_parser``: its parser's help ends with the suite's worked example."""

    @functools.wraps(build_parser)
    def build(*args, **kwargs) -> argparse.ArgumentParser:
        parser = build_parser(*args, **kwargs)
        parser.epilog = example(command(parser.prog.removeprefix(PREFIX)))
        parser.formatter_class = ExampleHelpFormatter
        return parser

    return build
