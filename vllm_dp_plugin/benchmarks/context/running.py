"""Running ``vllm-dp bench context``: the run's state (``Bench``: model, scenarios, work directory,
calibration, engine flags), servers, and every (row, eps) asked every question."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from vllm_dp_plugin.aggregate.facts import FactSheet
from vllm_dp_plugin.benchmarks.context.report import describe
from vllm_dp_plugin.benchmarks.context.rows import ROWS, Request, Row, Server
from vllm_dp_plugin.benchmarks.context.scoring import (
    Answer,
    sample,
    score,
    sheet_quality,
    summarize,
    unfit,
)
from vllm_dp_plugin.benchmarks.lib import vllm as vllm_lib
from vllm_dp_plugin.benchmarks.lib.scenarios import (
    ANSWER_TOKENS,
    ChatLayout,
    cached_calibration,
)
from vllm_dp_plugin.serving.aggregate import RECEIPT_FIELD
from vllm_dp_plugin.serving.memory import kv_shape


@dataclass
class Bench:
    model: str
    scenarios: list[dict]
    work: Path
    cache_dir: Path
    max_tokens: int = ANSWER_TOKENS
    concurrency: int = 8
    _calibration: Path | None = None
    _layout: ChatLayout | None = None
    _engine_flags: list[str] | None = None

    def calibration(self) -> Path:
        """The model's public calibration (``vllm-dp calibrate``), cached by weights digest."""
        if self._calibration is None:
            self._calibration = cached_calibration(self.model, self.cache_dir)
        return self._calibration

    def context_files(self, scenarios: Sequence[dict]) -> dict[str, str]:
        """One context file per scenario (its ``C``), named by the scenario id."""
        return self._scenario_files(scenarios, "contexts", ".txt",
                                    lambda s: self.layout().context_text(s["documents"]))

    def collection_files(self, scenarios: Sequence[dict]) -> dict[str, str]:
        """One document collection per scenario (JSONL, one document a line), named by its id."""
        return self._scenario_files(scenarios, "collections", ".jsonl", lambda s: "".join(
            json.dumps({"id": str(i), "text": d}) + "\n" for i, d in enumerate(s["documents"])))

    def _scenario_files(self, scenarios: Sequence[dict], folder: str, suffix: str,
                        render: Callable[[dict], str]) -> dict[str, str]:
        """scenario id -> ``work/folder/<id><suffix>`` holding ``render(scenario)`` (written once)."""
        where = self.work / folder
        where.mkdir(exist_ok=True)
        files = {}
        for s in scenarios:
            path = where / f"{s['id']}{suffix}"
            if not path.exists():
                path.write_text(render(s), encoding="utf-8")
            files[s["id"]] = str(path)
        return files

    @property
    def max_model_len(self) -> int:
        """Every server's ``--max-model-len``: the model's own maximum (a row whose requests need
        more does not fit)."""
        return kv_shape(self.model).max_positions

    def engine_flags(self) -> list[str]:
        """``benchmarks.lib.vllm.ENGINE_FLAGS``, ``--max-model-len`` and a KV cache (bytes) for ``concurrency``
        sequences of the longest plain request (documents + question + answer); the same for
        every server, so rows with equal servers share one."""
        if self._engine_flags is None:
            layout = self.layout()
            longest = max(len(layout.full_ids(s["documents"], q["q"])) for s in self.scenarios for q in s["questions"])
            tokens = min(self.max_model_len, longest + self.max_tokens)
            self._engine_flags = vllm_lib.engine_flags(self.model, self.concurrency, tokens=tokens,
                                                       max_model_len=self.max_model_len)
        return self._engine_flags

    def misfit(self, row: Row, scenarios: Sequence[dict]) -> str | None:
        """Why ``row`` cannot serve ``scenarios`` (a request longer than ``max_model_len``), or None."""
        layout = self.layout()
        need = max(row.request(layout, s, q).expected_prompt_tokens for s in scenarios for q in s["questions"])
        if need + self.max_tokens <= self.max_model_len:
            return None
        return (f"does not fit: a request needs {need} + {self.max_tokens} tokens, the model holds "
                f"{self.max_model_len}")

    def layout(self) -> ChatLayout:
        if self._layout is None:
            from transformers import AutoTokenizer

            self._layout = ChatLayout(AutoTokenizer.from_pretrained(self.model))
        return self._layout


class RunningServer(vllm_lib.RunningServer):
    """``server`` started on a free local port until /health answers, stopped on exit
    (``benchmarks.lib.vllm.RunningServer``), and asked for completions."""

    def __init__(self, server: Server, log: Path, timeout: float = 900) -> None:
        super().__init__(server.cmd, log, vllm_lib.with_env(server.env), timeout)
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
    """Every question of ``scenarios``, ``bench.concurrency`` in flight; (answers, wall s), each
    scored (``scoring.score``) with its response's DP receipt (``dp_receipt``), if any.
    ``unserved``: the server serves no context (every one out of regime), so it sees the
    request's own tokens only; ``sheets``: scenario id -> its released fact sheet's text."""
    layout = bench.layout()

    def sheet_text(s, q):
        sheet = (sheets or {}).get(s["id"])
        return None if sheet is None else sheet.about(q["q"]).system_text()

    jobs = [(s, q, row.request(layout, s, q, *([(sheets or {}).get(s["id"])] if row.sheets else [])))
            for s in scenarios for q in s["questions"]]

    def one(job) -> Answer:
        s, q, request = job
        out = server.complete(bench.model, request, bench.max_tokens)
        got = out["usage"]["prompt_tokens"]
        expected = len(request.prompt) if unserved else request.expected_prompt_tokens
        if got != expected:
            raise RuntimeError(f"{label}: scenario {s['id']} question {q['q']!r}: the server saw {got} prompt "
                               f"tokens, the layout expects {expected}")
        text = out["choices"][0]["text"]
        if progress is not None:
            progress.update(1)
        sources = list(s["documents"]) if row.plain_documents else []
        if row.sheets and (shown := sheet_text(s, q)):
            sources.append(shown)
        return score(s, q, text, got, out.get(RECEIPT_FIELD), sources)

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
    out = []
    for name in rows:
        if name not in ROWS:
            raise SystemExit(f"unknown row {name!r}; known rows: {', '.join(ROWS)}")
        out += [(name, e) for e in eps] if ROWS[name].private else [(name, None)]
    return out


def _serve(up: contextlib.ExitStack, running: RunningServer | None, spec: Server, log: Path) -> RunningServer:
    """``running`` if it runs ``spec`` (rows with the same server share it), else a new server for
    ``spec`` on ``up`` after stopping the old one."""
    if running is not None and running.server == spec:
        return running
    up.close()
    return up.enter_context(RunningServer(spec, log))


def run(bench: Bench, rows: Sequence[str], eps: Sequence[float], log=None,
        after_row=None) -> tuple[list[dict], list[dict], list[dict]]:
    """Measure every (row, eps); returns (result rows, budget statements, every answer as
    ``scoring.sample`` keeps it), also handed to ``after_row`` after each row."""
    from tqdm import tqdm

    log = log or tqdm.write
    jobs = jobs_of(rows, eps)
    n_questions = sum(len(s["questions"]) for s in bench.scenarios)
    results, budgets, samples = [], [], []
    server: RunningServer | None = None
    with contextlib.ExitStack() as up, tqdm(total=len(jobs), desc="rows", unit="row", position=0) as bar:
        for name, e in jobs:
            row, label = ROWS[name], name if e is None else f"{name} eps={e:g}"
            answers, seconds, contexts = [], 0.0, []
            misfit = bench.misfit(row, bench.scenarios)
            if misfit is not None:
                results.append(unfit(name, e, misfit))
                log(f"vllm-dp bench context: {describe(results[-1])}")
                if after_row is not None:
                    after_row(results, budgets, samples)
                bar.update(1)
                continue
            with tqdm(total=n_questions, desc=label, unit="q", position=1, leave=False) as qbar:
                for part in server_parts(row, bench.scenarios):
                    tag = label.replace(" eps=", "@") + f"-{part[0]['id']}"
                    server = _serve(up, server, row.server(bench, e, part), bench.work / f"server-{tag}.log")
                    payload = server.get("/v1/dp/budget") if server.server.dp else {"contexts": []}
                    if payload["contexts"] and not answers:  # the statement of the row's first context
                        budgets.append({"row": name, "eps": e, **payload["contexts"][0]})
                    unserved = bool(payload["contexts"]) and all(c.get("releases") == 0 for c in payload["contexts"])
                    sheets = {c["name"]: FactSheet.from_json(c["facts"]) for c in payload["contexts"] if "facts" in c}
                    contexts += payload["contexts"]
                    got, wall = ask_all(bench, server, row, part, label, qbar, unserved, sheets)
                    answers, seconds = answers + got, seconds + wall
            result = summarize(name, e, answers, seconds)
            if row.sheets:
                result["sheet"] = sheet_quality(bench.scenarios, contexts)
            results.append(result)
            samples += [sample(name, e, a) for a in answers]
            log(f"vllm-dp bench context: {describe(result)}")
            if after_row is not None:  # the report so far: a stopped run keeps its rows
                after_row(results, budgets, samples)
            bar.update(1)
    return results, budgets, samples
