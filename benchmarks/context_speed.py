"""``python -m benchmarks.context_speed``: time per output token of DP aggregation against a stock request,
seconds per answer of an answer-level row over growing collections, and answers/s under concurrency
(``--sweep``), over the rows and servers of ``vllm-dp bench context``."""

from __future__ import annotations

import argparse
import platform
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import with_example
from benchmarks.lib.scenario_generator import SUPPORTS, make_scenario
from vllm_dp_plugin.benchmarks.context.rows import (
    ROWS,
    Request,
    _plain,
    aggregate_request,
    aggregate_server,
    stock_server,
)
from vllm_dp_plugin.benchmarks.context.running import Bench, RunningServer, ask_all
from vllm_dp_plugin.benchmarks.lib.cli import (
    add_out_arg,
    command_line,
    ints,
    names,
    parse,
    today,
)
from vllm_dp_plugin.benchmarks.lib.environment import default_device, device_label
from vllm_dp_plugin.benchmarks.lib.report import suffixed, write_json, write_text
from vllm_dp_plugin.benchmarks.lib.scenarios import (
    ANSWER_TOKENS,
    DEFAULT_CACHE,
    DEFAULT_MODEL,
    DEFAULT_MODEL_NAME,
    DEFAULT_SCENARIOS,
    ChatLayout,
    ensure_model,
    load_scenarios,
)

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
    log(f"python -m benchmarks.context_speed: stock {1000 * stock:.0f} ms/token")
    middle = sorted(members)[len(members) // 2]
    for k in members:
        spec = aggregate_server(mechanism, members=k)(bench, eps, bench.scenarios)
        with RunningServer(spec, bench.work / f"speed-k{k}.log") as server:
            timed(server, aggregate_request, {})  # warm-up: the members' prefixes enter the cache
            wall, tokens = timed(server, aggregate_request, {})
            rows.append({"setting": f"aggregate_{mechanism}, k = {k}", "members": k, "concurrency": 1,
                         "s_per_token": wall / tokens, "ratio_to_stock": wall / tokens / stock, "tokens": tokens})
            log(f"python -m benchmarks.context_speed: k={k} {1000 * wall / tokens:.0f} ms/token "
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
            log(f"python -m benchmarks.context_speed: {n} documents, {name}: {wall / len(answers):.2f} s/answer")
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
                log(f"python -m benchmarks.context_speed --sweep: {name}, {c} in flight: {median(rates):.3f} answers/s "
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


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"Hugging Face model directory (default {DEFAULT_MODEL}, built with "
                             f"`vllm-dp import-model {DEFAULT_MODEL_NAME}` when missing)")
    parser.add_argument("--scenarios", type=Path, default=DEFAULT_SCENARIOS,
                        help="scenarios JSONL of the stock-vs-vote rows (default: the bundled 24 scenarios)")
    parser.add_argument("--rows", default="",
                        help="empty: stock (full context as plain prompt) vs aggregate_vote at k = "
                             f"{', '.join(map(str, SPEED_MEMBERS))}, one request at a time, and throughput at "
                             f"--concurrency; one of {', '.join(ANSWER_ROWS)}: seconds per answer of full and that "
                             f"row over {', '.join(map(str, ANSWER_DOCUMENTS))} documents")
    parser.add_argument("--eps", type=float, default=8.0, help="eps per query of the private rows (default 8)")
    parser.add_argument("--sweep", metavar="LEVELS",
                        help="with --rows full and one of " + ", ".join(ANSWER_ROWS) + " (or one of them): "
                             f"answers/s at each of these numbers of questions in flight (comma-separated, e.g. "
                             f"1,4,16), {SWEEP_REPEATS} repeats, median, on generated collections")
    parser.add_argument("--quick", action="store_true", help="8 answer tokens (smoke run)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the calibration is cached")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (stock-vs-vote rows)")
    return add_out_arg(parser)


@with_example
def build_parser(prog: str = "python -m benchmarks.context_speed") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    args, argv = parse(args, build_parser)
    rows = list(names(args.rows))
    answer = len(rows) == 1 and rows[0] in ANSWER_ROWS
    if args.sweep and (not rows or set(rows) - {"full", *ANSWER_ROWS} or len(set(rows) & set(ANSWER_ROWS)) > 1):
        raise SystemExit("--sweep measures --rows full and one of " + ", ".join(ANSWER_ROWS) +
                         " (either alone: one timed run each)")
    if not args.sweep and rows and not answer:
        raise SystemExit(f"--rows: empty (stock vs vote) or one of {', '.join(ANSWER_ROWS)}")
    max_tokens = 8 if args.quick else ANSWER_TOKENS
    model = ensure_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-dp-bench-context-speed-"))
    started = time.perf_counter()
    device, date = device_label(default_device()), today()
    data = {"model": model, "device": device, "date": date,
            "command": command_line("python -m benchmarks.context_speed", argv, quote=False), "eps": args.eps}
    if args.sweep:
        data.update(mechanism="answer", repeats=SWEEP_REPEATS,
                    rows=answer_sweep(model, work, args.cache_dir, ints(args.sweep), args.eps, max_tokens, rows=rows))
        stem, write = args.out / f"context-answer-sweep-{'-'.join(rows)}-{device}-{date}", sweep_markdown
    elif answer:
        data.update(mechanism="answer",
                    rows=answer_speed(model, work, args.cache_dir, ANSWER_DOCUMENTS, args.eps, max_tokens, rows[0]))
        kind = rows[0].removeprefix("aggregate_")  # answer / answer_batch / extract
        stem, write = args.out / f"context-{kind}-speed-{device}-{date}", answer_speed_markdown
    else:
        bench = Bench(model, load_scenarios(args.scenarios), work, args.cache_dir, max_tokens, args.concurrency)
        data.update(mechanism="vote", rows=speed(bench, SPEED_MEMBERS, args.eps))
        stem, write = args.out / f"context-speed-{device}-{date}", speed_markdown
    data.update(platform=platform.platform(), wall_s=time.perf_counter() - started)
    write_json(suffixed(stem, ".json"), data, indent=1)
    write_text(suffixed(stem, ".md"), write(data))
    print(suffixed(stem, ".md").read_text())
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
