"""``vllm-dp bench context --speed``: time per output token of DP aggregation against a stock request,
and seconds per answer of ``aggregate_answer`` over growing collections; their markdown."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_dp_plugin.benchmarks.context.rows import (
    ROWS,
    Request,
    _plain,
    aggregate_request,
    aggregate_server,
    stock_server,
)
from vllm_dp_plugin.benchmarks.context.running import Bench, RunningServer, ask_all
from vllm_dp_plugin.benchmarks.lib.scenario_generator import SUPPORTS, make_scenario
from vllm_dp_plugin.benchmarks.lib.scenarios import ChatLayout

SPEED_MEMBERS = (4, 8, 16)
SPEED_QUESTIONS = 6  # answered one at a time per setting (the first scenarios' questions)


def speed(bench: Bench, members: Sequence[int], eps: float, mechanism: str = "vote", log=print) -> list[dict]:
    """Time per output token, one request at a time (batch of 1): a stock request with the full
    context as plain prompt (``ignore_eos``, ``bench.max_tokens`` tokens), then an aggregated
    request (``mechanism`` at ``eps``) for each k in ``members``; then the aggregated throughput
    with ``bench.concurrency`` requests in flight at the middle k."""
    layout = bench.layout()
    jobs = [(s, q) for s in bench.scenarios for q in s["questions"]][:SPEED_QUESTIONS]
    rows = []

    def timed(server, make, extra, concurrency=1):
        def one(job):
            request = make(layout, *job)
            body = Request(request.prompt, request.expected_prompt_tokens, {**request.extra, **extra})
            return server.complete(bench.model, body, bench.max_tokens)["usage"]["completion_tokens"]

        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            tokens = sum(pool.map(one, jobs if concurrency == 1 else jobs * 2))
        return time.perf_counter() - start, tokens

    with RunningServer(stock_server(bench, None, bench.scenarios), bench.work / "speed-stock.log") as server:
        timed(server, _plain(ChatLayout.full_ids), {"ignore_eos": True})  # warm-up
        wall, tokens = timed(server, _plain(ChatLayout.full_ids), {"ignore_eos": True})
    stock = wall / tokens
    rows.append({"setting": "stock, full context as plain prompt", "members": None, "concurrency": 1,
                 "s_per_token": stock, "ratio_to_stock": 1.0, "tokens": tokens})
    log(f"vllm-dp bench context --speed: stock {1000 * stock:.0f} ms/token")
    middle = sorted(members)[len(members) // 2]
    for k in members:
        spec = aggregate_server(mechanism, members=k)(bench, eps, bench.scenarios)
        with RunningServer(spec, bench.work / f"speed-k{k}.log") as server:
            timed(server, aggregate_request, {})  # warm-up: the members' prefixes enter the cache
            wall, tokens = timed(server, aggregate_request, {})
            rows.append({"setting": f"aggregate_{mechanism}, k = {k}", "members": k, "concurrency": 1,
                         "s_per_token": wall / tokens, "ratio_to_stock": wall / tokens / stock, "tokens": tokens})
            log(f"vllm-dp bench context --speed: k={k} {1000 * wall / tokens:.0f} ms/token "
                f"({wall / tokens / stock:.2f}x stock)")
            if k == middle:
                wall, tokens = timed(server, aggregate_request, {}, bench.concurrency)
                rows.append({"setting": f"aggregate_{mechanism}, k = {k}, {bench.concurrency} in flight",
                             "members": k, "concurrency": bench.concurrency, "s_per_token": wall / tokens,
                             "ratio_to_stock": wall / tokens / stock, "tokens": tokens,
                             "tokens_per_s": tokens / wall})
    return rows


ANSWER_DOCUMENTS = (21, 50, 200)  # --speed --rows aggregate_answer: collection sizes
ANSWER_SPEED_SEED = 7  # their scenarios (generated, not the bundled ones)


def answer_speed(model: str, work: Path, cache_dir: Path, counts: Sequence[int], eps: float, max_tokens: int,
                 log=print) -> list[dict]:
    """Seconds per answer, one request at a time, of ``full`` and ``aggregate_answer`` at ``eps``
    over one generated scenario of each document count in ``counts`` (its 7 questions after a
    warm-up question that fills the prefix cache): how the members' batch grows with the collection."""
    rows = []
    for n in counts:
        scenario = make_scenario(random.Random(ANSWER_SPEED_SEED), 0, extra_docs=n - max(SUPPORTS))
        bench = Bench(model, [scenario], work / f"docs{n}", cache_dir, max_tokens, concurrency=1)
        bench.work.mkdir(exist_ok=True)
        for name, e in (("full", None), ("aggregate_answer", eps)):
            row = ROWS[name]
            why = bench.misfit(row, [scenario])
            if why is not None:
                rows.append({"documents": n, "row": name, "eps": e, "s_per_answer": None, "note": why})
                continue
            with RunningServer(row.server(bench, e, [scenario]), bench.work / f"speed-{name}.log") as server:
                ask_all(bench, server, row, [{**scenario, "questions": scenario["questions"][:1]}], name)  # warm-up
                answers, wall = ask_all(bench, server, row, [scenario], name)
            rows.append({"documents": n, "row": name, "eps": e, "s_per_answer": wall / len(answers),
                         "correct": sum(a.correct for a in answers), "questions": len(answers)})
            log(f"vllm-dp bench context --speed: {n} documents, {name}: {wall / len(answers):.2f} s/answer")
    return rows


def answer_speed_markdown(data: dict) -> str:
    lines = [f"# Answer-level aggregation speed ({data['model']}, {data['device']}, {data['date']})", "",
             (f"`{data['command']}`; one generated scenario (seed {ANSWER_SPEED_SEED}) per collection size, its "
              f"questions one at a time after a warm-up question; `aggregate_answer` at eps = {data['eps']:g} per query "
              "(one member per document)."), "",
             "| documents | row | s / answer | x full | correct |", "|---|---|---|---|---|"]
    full = {r["documents"]: r["s_per_answer"] for r in data["rows"] if r["row"] == "full"}
    for r in data["rows"]:
        if r["s_per_answer"] is None:
            lines.append(f"| {r['documents']} | {r['row']} | {r['note']} | | |")
            continue
        ratio = f"{r['s_per_answer'] / full[r['documents']]:.1f}" if full.get(r["documents"]) else ""
        lines.append(f"| {r['documents']} | {r['row']} | {r['s_per_answer']:.2f} | {ratio} | "
                     f"{r['correct']} of {r['questions']} |")
    return "\n".join(lines) + "\n"


def speed_markdown(data: dict) -> str:
    lines = [f"# DP aggregation speed ({data['model']}, {data['device']}, {data['date']})", "",
             (f"`{data['command']}`; eps = {data['eps']:g} per query, mechanism {data['mechanism']}; time per "
             "output token = wall time of a request / its output tokens (prefill included), requests one at a "
             f"time unless stated; {SPEED_QUESTIONS} questions per setting after a warm-up pass."), "",
             "| setting | s / token | x stock | tokens | tokens / s |", "|---|---|---|---|---|"]
    for r in data["rows"]:
        tps = f"{r['tokens_per_s']:.1f}" if "tokens_per_s" in r else ""
        lines.append(f"| {r['setting']} | {r['s_per_token']:.3f} | {r['ratio_to_stock']:.2f} | {r['tokens']} | {tps} |")
    return "\n".join(lines) + "\n"
