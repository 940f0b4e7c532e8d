"""Steady-state engine throughput: one ``vllm.LLM`` engine generates the same batch ``rounds`` times.

``vllm bench throughput`` times one ``generate`` call per engine start (~60 s of start-up for a
few seconds of work), so on a VM with CPU steal a single slow period decides a row. This runs
the same workload (a P-token prefix, plain or private, + S random suffix tokens, O output
tokens with ``ignore_eos``) once to warm up (and release the private context), then ``rounds``
times, and prints every round's wall and process CPU seconds as one ``RESULT {json}`` line.

Run as ``python -m vllm_dp_plugin.benchmarks.steady JOB_JSON`` (CPU vLLM spawns workers:
hence the ``__main__`` guard); ``benchmarks/serve.py`` drives it.
"""

from __future__ import annotations

import json
import random
import sys
import time


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


def main(job: dict) -> None:
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: CPU time counts
    from vllm import LLM

    llm = LLM(**job["llm"])
    rounds = timed_rounds(llm, prompts(job), job["output_len"], job["rounds"])
    print("RESULT " + json.dumps(rounds), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
