"""Steady-state engine throughput: one ``vllm.LLM`` engine generates the same batch ``rounds`` times.

``vllm bench throughput`` times one ``generate`` per engine start: on a VM with CPU steal one slow period
decides a row. This warms up, runs the batch ``rounds`` times and prints every round's wall and process CPU
seconds as one ``RESULT {json}`` line; ``vllm-dp bench serve`` runs it as ``python -m`` (a ``__main__``:
CPU vLLM spawns workers).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Sequence

from vllm_dp_plugin.benchmarks.lib.cli import parse


def prompts(job: dict) -> list[dict]:
    """``num_prompts`` prompts: ``prefix_ids`` (none for DP: the renderer adds it) + ``suffix_len`` random ids."""
    rng, prefix = random.Random(job["seed"]), job["prefix_ids"]
    return [{"prompt_token_ids": prefix + [rng.randrange(10, job["vocab_size"]) for _ in range(job["suffix_len"])]}
            for _ in range(job["num_prompts"])]


def timed_rounds(llm, batch: list[dict], output_len: int, rounds: int) -> list[dict]:
    """Wall and process CPU seconds of ``rounds`` identical ``generate`` calls."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    llm.generate(batch[: max(1, len(batch) // 8)], params, use_tqdm=False)  # warm-up
    out = []
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        llm.generate(batch, params, use_tqdm=False)
        out.append({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu})
    return out


def run(job: dict) -> list[dict]:
    """Start the engine of ``job["llm"]`` in this process and time its rounds."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: CPU time counts
    from vllm import LLM

    return timed_rounds(LLM(**job["llm"]), prompts(job), job["output_len"], job["rounds"])


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("job", type=json.loads, metavar="JOB_JSON", help="llm (vllm.LLM keyword arguments), "
                        "prefix_ids, suffix_len, output_len, num_prompts, rounds, seed, vocab_size")
    return parser


def build_parser() -> argparse.ArgumentParser:
    prog = "python -m vllm_dp_plugin.benchmarks.steady"
    return add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Prints every round as one ``RESULT [{"wall_s", "cpu_s"}, ...]`` line."""
    args, _ = parse(args, build_parser)
    print("RESULT " + json.dumps(run(args.job)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
