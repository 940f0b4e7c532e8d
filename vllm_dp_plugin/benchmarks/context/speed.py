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


ANSWER_DOCUMENTS = (21, 200, 1000)  # --speed --rows aggregate_answer (or aggregate_extract): collection sizes
ANSWER_ROWS = ("aggregate_answer", "aggregate_answer_batch", "aggregate_extract")  # the answer-level rows --speed and --sweep time
ANSWER_SPEED_SEED = 7  # their scenarios (generated, not the bundled ones)
SWEEP_LEVELS = (1, 4, 16)  # --sweep: queries in flight
SWEEP_DOCUMENTS = 21  # documents per collection of the sweep (answer_speed's smallest size)
SWEEP_SCENARIOS = 3  # generated collections of the sweep (seed ANSWER_SPEED_SEED): 21 questions
SWEEP_REPEATS = 3


def sweep_scenarios(count: int = SWEEP_SCENARIOS, documents: int = SWEEP_DOCUMENTS) -> list[dict]:
    """The sweep's generated scenarios (seed ``ANSWER_SPEED_SEED``), ``documents`` documents each."""
    rng = random.Random(ANSWER_SPEED_SEED)
    return [make_scenario(rng, i, extra_docs=documents - max(SUPPORTS)) for i in range(count)]


def answer_speed(model: str, work: Path, cache_dir: Path, counts: Sequence[int], eps: float, max_tokens: int,
                 private: str = "aggregate_answer", log=print) -> list[dict]:
    """Seconds per answer, one request at a time, of ``full`` and ``private`` (an ``ANSWER_ROWS``
    row) at ``eps`` over one generated scenario of each document count in ``counts`` (its 7
    questions after a warm-up question that fills the prefix cache): how the members' cost grows
    with the collection."""
    rows = []
    for n in counts:
        scenario = make_scenario(random.Random(ANSWER_SPEED_SEED), 0, extra_docs=n - max(SUPPORTS))
        bench = Bench(model, [scenario], work / f"docs{n}", cache_dir, max_tokens, concurrency=1)
        bench.work.mkdir(exist_ok=True)
        for name, e in (("full", None), (private, eps)):
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
              f"questions one at a time after a warm-up question; the answer-level row at eps = {data['eps']:g} per "
              "query (one member per document)."), "",
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


# --sweep: a preamble per measurement so that no prompt repeats (a repeated prompt would be served
# from the prefix cache whole, stock and members alike); public text, the same for both rows
PREAMBLES = ("", "Question: ", "Please answer: ", "Tell me: ", "I would like to know: ", "Quick question: ",
             "One more question: ", "Can you tell me? ", "Help me with this: ", "I wonder: ", "Answer this: ")


def sweep_jobs(scenarios: Sequence[dict], levels: Sequence[int], repeats: int) -> dict[tuple[int, int], list]:
    """(in flight, repeat) -> its questions: ``max(4, c)`` (scenario, question) pairs, round-robin over the
    scenarios, each question under a preamble no other measurement uses with it (the first pairs,
    preamble "", are the warm-up's)."""
    base = [(s, q) for i in range(max(len(s["questions"]) for s in scenarios)) for s in scenarios
            for q in s["questions"][i:i + 1]]
    pairs = iter([(s, {**q, "q": p + q["q"]}) for p in PREAMBLES for s, q in base])
    warm = [next(pairs) for _ in scenarios]
    out = {(0, 0): warm}
    for c in levels:
        for r in range(repeats):
            out[(c, r)] = [next(pairs) for _ in range(max(4, c))]  # StopIteration: add preambles
    return out


def answer_sweep(model: str, work: Path, cache_dir: Path, levels: Sequence[int], eps: float, max_tokens: int,
                 repeats: int = SWEEP_REPEATS, rows: Sequence[str] = ("full", "aggregate_answer"),
                 log=print) -> list[dict]:
    """Answers per second with ``c`` questions in flight (each of ``levels``; ``max(4, c)`` questions,
    ``repeats`` times, median) of ``full`` (stock vLLM, the whole context as plain prompt) and
    ``aggregate_answer`` at ``eps`` (one member per document), on the same engine settings (a KV
    cache for ``max(levels)`` full requests) and the same questions: ``SWEEP_SCENARIOS`` generated
    collections of ``SWEEP_DOCUMENTS`` documents, after a warm-up question per collection (the
    documents' prefixes cached, as in a running server); no prompt is asked twice."""
    from statistics import median

    from vllm_dp_plugin.benchmarks.lib.scenarios import is_correct

    scenarios = sweep_scenarios()
    bench = Bench(model, scenarios, work / "sweep", cache_dir, max_tokens, concurrency=max(levels))
    bench.work.mkdir(exist_ok=True)
    layout = bench.layout()
    jobs = sweep_jobs(scenarios, levels, repeats)
    out = []
    for name in rows:
        row, e = ROWS[name], (eps if ROWS[name].private else None)

        def one(job, row=row):
            s, q = job
            text = server.complete(bench.model, row.request(layout, s, q), bench.max_tokens)["choices"][0]["text"]
            return is_correct(text, q["answers"])

        with RunningServer(row.server(bench, e, scenarios), bench.work / f"sweep-{name}.log") as server:
            with ThreadPoolExecutor(len(scenarios)) as pool:
                list(pool.map(one, jobs[(0, 0)]))  # warm-up
            for c in levels:
                rates, correct = [], 0
                for r in range(repeats):
                    start = time.perf_counter()
                    with ThreadPoolExecutor(c) as pool:
                        right = list(pool.map(one, jobs[(c, r)]))
                    rates.append(len(right) / (time.perf_counter() - start))
                    correct += sum(right)
                n = len(jobs[(c, 0)])
                out.append({"row": name, "eps": e, "in_flight": c, "answers": n, "repeats": repeats,
                            "answers_per_s": median(rates), "answers_per_s_each": rates,
                            "correct": correct, "asked": n * repeats})
                log(f"vllm-dp bench context --speed --sweep: {name}, {c} in flight: {median(rates):.3f} answers/s "
                    f"(median of {', '.join(f'{x:.3f}' for x in rates)}), {correct} of {n * repeats} correct")
    return out


def sweep_markdown(data: dict) -> str:
    private = next((r["row"] for r in data["rows"] if r["row"] in ANSWER_ROWS), ANSWER_ROWS[0])
    lines = [(f"# Answer-level aggregation throughput under concurrency ({data['model']}, {data['device']}, "
              f"{data['date']})"), "",
             (f"`{data['command']}`; {SWEEP_SCENARIOS} generated collections (seed {ANSWER_SPEED_SEED}) of "
              f"{SWEEP_DOCUMENTS} documents; `full`: stock vLLM with the documents as plain prompt; "
              f"`{private}` at eps = {data['eps']:g} per query (one member per document); both on the same "
              "engine settings (KV cache for 16 full requests); max(4, c) questions per measurement with c in "
              f"flight, no prompt asked twice, {data['repeats']} repeats, median."), "",
             (f"| in flight | full answers/s | {private} answers/s | aggregate / full | correct (full, aggregate) "
              "| each repeat (full; aggregate) |"), "|---|---|---|---|---|---|"]
    by = {(r["row"], r["in_flight"]): r for r in data["rows"]}
    for c in sorted({r["in_flight"] for r in data["rows"]}):
        f, a = by.get(("full", c)), by.get((private, c))
        ratio = f"{a['answers_per_s'] / f['answers_per_s']:.2f}" if f and a else ""
        cells = [f"{x['answers_per_s']:.3f}" if x else "" for x in (f, a)]
        right = ", ".join(f"{x['correct']} of {x['asked']}" if x else "-" for x in (f, a))
        each = "; ".join(", ".join(f"{v:.3f}" for v in x.get("answers_per_s_each", ())) if x else "-" for x in (f, a))
        lines.append(f"| {c} | {cells[0]} | {cells[1]} | {ratio} | {right} | {each} |")
    return "\n".join(lines) + "\n"
