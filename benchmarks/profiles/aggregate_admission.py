"""Profile of DP aggregation's admission (``aggregate.mechanism: answer``) in one process: a vLLM
``AsyncLLM`` with the engine settings of ``python -m benchmarks.context_speed --sweep`` (the KV cache of
16 full-context requests), ``AggregateService`` over it, ``c`` queries in flight; a stat logger
records the scheduler's running / waiting counts and KV cache use at every engine step (the numbers
``vllm:num_requests_running`` and the "Running: N reqs, Waiting: M" log line show; the DP server
closes both, so they are read here, in a profiling process, from generated scenarios only).

    PYTHONPATH=. python benchmarks/profiles/aggregate_admission.py --levels 1,4,16 --out /tmp/adm.json
    py-spy record -o /tmp/adm.svg --subprocesses -- python benchmarks/profiles/aggregate_admission.py ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path

MODEL = ".models/smollm2-135m-instruct"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=MODEL)
    p.add_argument("--levels", default="1,4,16")
    p.add_argument("--rows", default="aggregate_answer,full")
    p.add_argument("--kv-sequences", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("/tmp/admission.json"))
    args = p.parse_args()
    os.environ.setdefault("VLLM_PLUGINS", "")
    from vllm_dp_plugin.serving.vllm_compat import install_version_shim

    install_version_shim()
    asyncio.run(run(args))


async def run(args) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase

    from benchmarks.context_speed import SWEEP_DOCUMENTS, sweep_jobs, sweep_scenarios
    from vllm_dp_plugin.benchmarks.lib.scenarios import ChatLayout
    from vllm_dp_plugin.config import AggregatePrivacyConfig
    from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
    from vllm_dp_plugin.privacy.ledger_store import open_store
    from vllm_dp_plugin.serving.aggregate import AggregateService
    from vllm_dp_plugin.serving.memory import kv_cache_bytes, kv_shape

    steps: list[tuple[float, int, int, float]] = []
    tokens = {"prompt_computed": 0, "prompt_cached": 0, "generated": 0, "finished": 0, "preempted": 0}

    class Recorder(StatLoggerBase):
        def __init__(self, vllm_config, engine_index=0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                steps.append((time.perf_counter(), scheduler_stats.num_running_reqs,
                              scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                              scheduler_stats.kv_cache_usage))
            if iteration_stats is not None:
                tokens["prompt_computed"] += iteration_stats.prompt_token_stats.computed
                tokens["prompt_cached"] += iteration_stats.prompt_token_stats.cached_tokens
                tokens["generated"] += iteration_stats.num_generation_tokens
                tokens["finished"] += len(iteration_stats.finished_requests)
                tokens["preempted"] += iteration_stats.num_preempted_reqs

        def log_engine_initialized(self):
            pass

    scenarios = sweep_scenarios()
    work = Path(tempfile.mkdtemp(prefix="adm-"))
    from transformers import AutoTokenizer

    layout = ChatLayout(AutoTokenizer.from_pretrained(args.model))
    longest = max(len(layout.full_ids(s["documents"], q["q"])) for s in scenarios for q in s["questions"])
    max_len = kv_shape(args.model).max_positions
    kv = kv_cache_bytes(args.model, max_len, args.kv_sequences, tokens=min(max_len, longest + 32))
    extra = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                ("max_num_batched_tokens", args.max_num_batched_tokens)) if v}
    engine_args = AsyncEngineArgs(model=args.model, dtype="float32", block_size=32, enforce_eager=True, seed=0,
                                  max_model_len=max_len, kv_cache_memory_bytes=kv, disable_log_stats=False, **extra)
    engine = AsyncLLM.from_engine_args(engine_args, stat_loggers=[Recorder])
    contexts = {}
    for s in scenarios:
        path = work / f"{s['id']}.jsonl"
        path.write_text("".join(json.dumps({"id": str(i), "text": d}) + "\n" for i, d in enumerate(s["documents"])))
        contexts[s["id"]] = str(path)
    cfg = AggregatePrivacyConfig(contexts=contexts, mechanism="answer", epsilon=4.0, delta=1e-6,
                                 total_epsilon=1e6)
    svc = AggregateService(cfg, engine, layout.tokenizer, NoiseKey(work / "noise.key"), args.model,
                           (layout.tokenizer.eos_token_id,), max_len, open_store(work / "ledger.sqlite"))
    levels = [int(x) for x in args.levels.split(",")]
    jobs = sweep_jobs(scenarios, levels, 1)  # no prompt asked twice (a repeat is served from the cache whole)
    out = {"model": args.model, "documents": SWEEP_DOCUMENTS, "kv_cache_bytes": kv, "engine": extra, "levels": []}

    async def aggregate(job):
        s, q = job
        body = {"prompt": layout.none_ids(s["documents"], q["q"]), "max_tokens": 32, "temperature": 0.0,
                "vllm_xargs": {"dp_context": s["id"]}}
        reply = await svc.handle("/v1/completions", body)
        assert reply.status_code == 200, reply.body

    async def full(job):
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input

        s, q = job
        ids = layout.full_ids(s["documents"], q["q"])
        async for _ in engine.generate(tokens_input(ids), SamplingParams(max_tokens=32, temperature=0.0),
                                       f"full-{random.getrandbits(64):x}"):
            pass

    kinds = {"aggregate_answer": aggregate, "full": full}
    for row in args.rows.split(","):
        await asyncio.gather(*(kinds[row](j) for j in jobs[(0, 0)]))  # warm-up: the documents' prefixes cached
        for c in levels:
            n = len(jobs[(c, 0)])
            sem = asyncio.Semaphore(c)

            async def bounded(job, sem=sem, ask=kinds[row]):
                async with sem:
                    await ask(job)

            del steps[:]
            tokens.update(dict.fromkeys(tokens, 0))
            start = time.perf_counter()
            await asyncio.gather(*(bounded(j) for j in jobs[(c, 0)]))
            wall = time.perf_counter() - start
            trace = [(round(t - start, 3), r, w, round(u, 3)) for t, r, w, u in steps]
            running = [r for _, r, _, _ in trace]
            level = {"row": row, "in_flight": c, "answers": n, "wall_s": wall, "answers_per_s": n / wall,
                     "steps": len(trace), "running_mean": sum(running) / max(1, len(running)),
                     "running_max": max(running, default=0), "waiting_max": max((w for _, _, w, _ in trace), default=0),
                     "kv_max": max((u for *_, u in trace), default=0.0),
                     **{f"{k}_per_answer": v / n for k, v in tokens.items()}, "trace": trace}
            out["levels"].append(level)
            print(f"{row} c={c}: {n / wall:.3f} answers/s, {len(trace)} steps, running mean "
                  f"{level['running_mean']:.1f} max {level['running_max']}, waiting max {level['waiting_max']}, "
                  f"kv max {level['kv_max']:.2f}; per answer: "
                  + ", ".join(f"{k} {v / n:.0f}" for k, v in tokens.items()), flush=True)
    args.out.write_text(json.dumps(out))
    engine.shutdown()


if __name__ == "__main__":
    main()
