"""Running ``vllm-dp bench context``: servers, and every (row, eps) asked every question."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_dp_plugin.aggregate.facts import FactSheet
from vllm_dp_plugin.benchmarks.context.report import describe
from vllm_dp_plugin.benchmarks.context.rows import ROWS, Bench, Request, Row, Server
from vllm_dp_plugin.benchmarks.context.scoring import (
    Answer,
    sample,
    score,
    sheet_quality,
    summarize,
    unfit,
)
from vllm_dp_plugin.benchmarks.lib import vllm as vllm_lib
from vllm_dp_plugin.serving.aggregate import RECEIPT_FIELD


class RunningServer(vllm_lib.RunningServer):
    """``lib.vllm.RunningServer`` of a ``Server`` (``server``), asked for completions."""

    def __init__(self, server: Server, log: Path) -> None:
        super().__init__(server.cmd, log, vllm_lib.with_env(server.env))
        self.server = server

    def complete(self, model: str, request: Request, max_tokens: int) -> dict:
        """The completion's JSON (a chat request's answer as ``choices[0].text``)."""
        chat = request.messages is not None
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, **request.extra,
                **({"messages": request.messages} if chat else {"prompt": request.prompt})}
        route = "/v1/chat/completions" if chat else "/v1/completions"
        req = urllib.request.Request(self.base + route, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=900) as response:
                out = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{route} answered {exc.code}: {exc.read()[:2000]!r}") from None
        if chat:
            out["choices"] = [{"text": c["message"]["content"] or ""} for c in out["choices"]]
        return out


def ask_all(bench: Bench, server: RunningServer, row: Row, scenarios: Sequence[dict], label: str,
            progress=None, unserved: bool = False, sheets: dict | None = None) -> tuple[list[Answer], float]:
    """(scored answers, wall s) of every question of ``scenarios``, ``bench.concurrency`` in flight;
    ``unserved``: no context is served (all out of regime); ``sheets``: scenario id -> released sheet."""
    layout = bench.layout()

    def job(s: dict, q: dict) -> tuple[dict, dict, Request, list[str]]:
        """(scenario, question, request, the text the model is given in plain: documents, sheet)."""
        sheet = (sheets or {}).get(s["id"]) if row.sheets else None
        shown = None if sheet is None else sheet.about(q["q"]).system_text()
        request = row.request(layout, s, q) if shown is None else row.request(layout, s, q, shown)
        return s, q, request, [*(s["documents"] if row.plain_documents else []), *([shown] if shown else [])]

    def one(job) -> Answer:
        s, q, request, sources = job
        out = server.complete(bench.model, request, bench.max_tokens)
        got = out["usage"]["prompt_tokens"]
        expected = len(request.prompt) if unserved else request.expected_prompt_tokens
        if got != expected:
            raise RuntimeError(f"{label}: scenario {s['id']} question {q['q']!r}: the server saw {got} prompt "
                               f"tokens, the layout expects {expected}")
        if progress is not None:
            progress.update(1)
        return score(s, q, out["choices"][0]["text"], out.get(RECEIPT_FIELD), sources)

    jobs = [job(s, q) for s in scenarios for q in s["questions"]]
    start = time.perf_counter()
    with ThreadPoolExecutor(bench.concurrency) as pool:
        answers = list(pool.map(one, jobs))
    return answers, time.perf_counter() - start


def server_parts(row: Row, scenarios: Sequence[dict]) -> list[list[dict]]:
    """``scenarios`` in consecutive parts of at most ``row.contexts_per_server`` (one server each)."""
    size = row.contexts_per_server or max(1, len(scenarios))
    return [list(scenarios[i:i + size]) for i in range(0, len(scenarios), size)]


def jobs_of(rows: Sequence[str], eps: Sequence[float]) -> list[tuple[str, float | None]]:
    """(row, eps) pairs in order: non-private rows once, private rows at every eps."""
    if unknown := [name for name in rows if name not in ROWS]:
        raise SystemExit(f"unknown row {unknown[0]!r}; known rows: {', '.join(ROWS)}")
    return [(name, e) for name in rows for e in (eps if ROWS[name].private else [None])]


def run(bench: Bench, rows: Sequence[str], eps: Sequence[float], log=None,
        after_row=None) -> tuple[list[dict], list[dict], list[dict]]:
    """(result rows, budget statements, sampled answers) of every (row, eps), also after each row to ``after_row``."""
    from tqdm import tqdm

    log = log or tqdm.write
    jobs = jobs_of(rows, eps)
    n_questions = sum(len(s["questions"]) for s in bench.scenarios)
    results, budgets, samples = [], [], []
    server: RunningServer | None = None
    with contextlib.ExitStack() as up, tqdm(total=len(jobs), desc="rows", unit="row", position=0) as bar:
        for name, e in jobs:
            row, label = ROWS[name], name if e is None else f"{name} eps={e:g}"
            misfit = bench.misfit(row, bench.scenarios)
            if misfit is not None:
                results.append(unfit(name, e, misfit))
            else:
                answers, seconds, contexts = [], 0.0, []
                with tqdm(total=n_questions, desc=label, unit="q", position=1, leave=False) as qbar:
                    for part in server_parts(row, bench.scenarios):
                        spec = row.server(bench, e, part)
                        if server is None or server.server != spec:  # rows with equal servers share one
                            up.close()
                            tag = label.replace(" eps=", "@") + f"-{part[0]['id']}"
                            server = up.enter_context(RunningServer(spec, bench.work / f"server-{tag}.log"))
                        served = server.get("/v1/dp/budget")["contexts"] if server.server.dp else []
                        if served and not answers:  # the statement of the row's first context
                            budgets.append({"row": name, "eps": e, **served[0]})
                        unserved = bool(served) and all(c.get("releases") == 0 for c in served)
                        sheets = {c["name"]: FactSheet.from_json(c["facts"]) for c in served if "facts" in c}
                        contexts += served
                        got, wall = ask_all(bench, server, row, part, label, qbar, unserved, sheets)
                        answers, seconds = answers + got, seconds + wall
                results.append(summarize(name, e, answers, seconds))
                if row.sheets:
                    results[-1]["sheet"] = sheet_quality(bench.scenarios, contexts)
                samples += [sample(name, e, a) for a in answers]
            log(f"vllm-dp bench context: {describe(results[-1])}")
            if after_row is not None:  # the report so far: a stopped run keeps its rows
                after_row(results, budgets, samples)
            bar.update(1)
    return results, budgets, samples
