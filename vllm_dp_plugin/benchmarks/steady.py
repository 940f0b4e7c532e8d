"""Steady-state engine throughput: one ``vllm.LLM`` engine generates the same batch ``rounds`` times.

``vllm bench throughput`` times one ``generate`` call per engine start (~60 s of start-up for a
few seconds of work), so on a VM with CPU steal a single slow period decides a row. This runs
the same workload (a P-token prefix, plain or private, + S random suffix tokens, O output
tokens with ``ignore_eos``) once to warm up (and release the private context), then ``rounds``
times, and prints every round's wall and process CPU seconds as one ``RESULT {json}`` line.

Run as ``python -m vllm_dp_plugin.benchmarks.steady JOB_JSON`` (CPU vLLM spawns workers:
hence the ``__main__`` guard); ``vllm-dp bench serve`` (``benchmarks.serve``) drives it.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence

from vllm_dp_plugin.benchmarks.lib.cli import parse


def prompts(job: dict) -> list[dict]:
    """``num_prompts`` token-id prompts: ``prefix_ids`` (empty for DP rows: the renderer adds
    the private context) + ``suffix_len`` random ids from ``[10, vocab_size)``."""
    rng = random.Random(job["seed"])
    return [
        {"prompt_token_ids": job["prefix_ids"] + [rng.randrange(10, job["vocab_size"]) for _ in range(job["suffix_len"])]}
        for _ in range(job["num_prompts"])
    ]


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
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: CPU time counts
    from vllm import LLM

    llm = LLM(**job["llm"])
    return timed_rounds(llm, prompts(job), job["output_len"], job["rounds"])


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("job", type=json.loads, metavar="JOB_JSON",
                        help="llm (vllm.LLM keyword arguments), prefix_ids, suffix_len, output_len, "
                             "num_prompts, rounds, seed, vocab_size")
    return parser


def build_parser(prog: str = "python -m vllm_dp_plugin.benchmarks.steady") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Prints every round as one ``RESULT [{"wall_s", "cpu_s"}, ...]`` line."""
    args, _ = parse(args, build_parser)
    print("RESULT " + json.dumps(run(args.job)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
