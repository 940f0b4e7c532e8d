"""One served configuration's trials, chained: the server under load (``Load``: asyncio + httpx
clients) is killed (``kill -9`` of its API server or of the engine core found in its process tree,
at a seeded random time), restarted on the same configuration, key and ledgers, checked, and the
restarted server carries the next trial. Times of a load: seconds from its start."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import httpx
import psutil
import yaml

from vllm_dp_plugin.benchmarks.lib.environment import loadavg
from vllm_dp_plugin.benchmarks.lib.vllm import VLLM_DP, RunningServer, engine_flags
from vllm_dp_plugin.demo import make_demo_llama
from vllm_dp_plugin.privacy.accountant import Budget

from . import checks

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
STOP_TIMEOUT = 30.0  # seconds a killed server's survivors get to exit on SIGTERM
BUDGET = "/v1/dp/budget"
API_SERVER, ENGINE_CORE = "api-server", "engine-core"
TARGETS = (API_SERVER, ENGINE_CORE)
ENGINE_TITLE = "VLLM::EngineCore"  # the engine core's process title
# public questions about the bundled northwind collection (aggregation) and plain prompts (DP attention)
QUESTIONS = ("When is the Seattle warehouse closed?", "What is the dairy price increase?",
             "Which warehouse ships orders during inventory?", "What changes in Q3?")
PROMPTS = ("The meeting is on", "Our company sells", "The answer to the question is")
FINGERPRINT_TOKENS = 16
TIMEOUT = httpx.Timeout(300.0, connect=10.0)


class Setup(NamedTuple):
    """A served configuration: ``name``, the example config it copies, the model (None: the
    demo model, made in the run's directory), whether it serves DP aggregation."""

    name: str
    example: str
    model: str | None
    aggregate: bool


SETUPS = {s.name: s for s in (
    Setup("aggregate", "serve-smollm2-aggregate.yaml", ".models/smollm2-135m-instruct", True),  # northwind
    # the public gate closes every layer of SmolLM2: the answers do not use the release; the demo's do
    Setup("attention-smollm2", "serve-smollm2.yaml", ".models/smollm2-135m-instruct", False),
    Setup("attention-demo", "serve-dp.yaml", None, False),
)}


def write_config(setup: Setup, work: Path, mechanism: str, total_epsilon: float, max_tokens: int) -> Path:
    """The example config with its paths resolved and its state (key, ledgers, the demo model's
    calibration) in ``work``; aggregation with ``mechanism``, ``total_epsilon`` and ``max_tokens``."""
    raw = yaml.safe_load((EXAMPLES / setup.example).read_text())
    dp = raw["dp_privacy"]
    dp["key_file"], dp["ledger_file"] = str(work / "noise.key"), str(work / "releases.jsonl")
    if setup.aggregate:
        agg = dp["aggregate"]
        agg["contexts"] = {name: str((EXAMPLES / src).resolve()) for name, src in agg["contexts"].items()}
        agg.update(budget_file=str(work / "queries.jsonl"), mechanism=mechanism, total_epsilon=total_epsilon,
                   max_tokens=max_tokens)
    else:
        att = dp["attention"]
        att.update({key: str((EXAMPLES / att[key]).resolve()) for key in ("private_context", "calibration")})
        if setup.model is None:
            att["calibration"] = str(work / "calibration.json")
    (work / "dp.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return work / "dp.yaml"


class Trials:
    """The chained trials of one setup (``run``) in a fresh ``--work/<setup>`` (the demo model made
    there), with the suite's options (``args``): its server command, seeded kill times."""

    def __init__(self, setup: Setup, args: argparse.Namespace, seed: int, log: Callable[[str], None]) -> None:
        self.setup, self.args, self.seed, self.log = setup, args, seed, log
        self.work = args.work / setup.name
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.model = setup.model or str(make_demo_llama(self.work / "model"))
        config = write_config(setup, self.work, args.mechanism, args.total_epsilon, args.max_tokens)
        self.cmd = [*VLLM_DP, "serve", self.model, "--dp-config", str(config),
                    *engine_flags(self.model, args.clients + 2, max_model_len=args.max_model_len)]
        self.kill_min, self.kill_max = args.kill_window
        self.starts, self.rows = 0, []
        self.rng = random.Random(seed)

    def start(self) -> tuple[RunningServer, float]:
        """A server started (healthy) and the seconds it took."""
        self.starts += 1
        server = RunningServer(self.cmd, self.work / f"serve-{self.starts}.log", stop_timeout=STOP_TIMEOUT)
        began = time.monotonic()
        server.__enter__()  # chained: the next trial runs on it; stop() closes it
        return server, time.monotonic() - began

    def run(self, on_row: Callable[[], None]) -> None:
        """``--trials`` per target, interleaved, into ``rows``; ``on_row()`` after each (incremental results)."""
        server, started = self.start()
        self.log(f"{self.setup.name}: first start {started:.0f} s")
        reference = self.release(server) if not self.setup.aggregate else None
        try:
            for index in range(self.args.trials * len(self.args.targets)):
                target = self.args.targets[index % len(self.args.targets)]
                row, server = self.trial(server, index, target, reference)
                self.rows.append(row)
                on_row()
                self.log(f"{self.setup.name} #{index} {target}: kill at {row['kill_at_s']:.1f} s, "
                         f"{row['in_flight']} in flight, restart {row['restart_s']} s, "
                         f"{'passed' if row['passed'] else 'FAILED ' + str(row['checks'])}")
                if server is None:
                    break
        finally:
            if server is not None:
                server.stop()

    def trial(self, server: RunningServer, index: int, target: str,
              reference: dict | None) -> tuple[dict, RunningServer | None]:
        """One kill and restart; the row and the restarted server (None when it did not start)."""
        kill_at = self.rng.uniform(self.kill_min, self.kill_max)
        before = server.get(BUDGET) if self.setup.aggregate else None
        pid = victim(target, server.proc.pid)
        traffic = Load(server.base, self.setup.aggregate, self.args.clients, self.args.max_tokens,
                       self.seed * 100 + index, self.model)
        asyncio.run(traffic.run(kill_at, functools.partial(os.kill, pid, signal.SIGKILL)))
        began, api_exit = time.monotonic(), None  # seconds until the API server exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(STOP_TIMEOUT)
            api_exit = time.monotonic() - began
        server.stop()
        row = {"setup": self.setup.name, "trial": index, "target": target, "pid": pid,
               "kill_at_s": traffic.killed_at, "in_flight": traffic.in_flight, "api_exit_s": api_exit,
               "loadavg": loadavg(), **counts(traffic.outcomes, self.setup.aggregate), "restart_errors": []}
        for _ in range(self.args.restart_attempts):
            try:
                server, row["restart_s"] = self.start()
                break
            except RuntimeError as exc:  # the log's tail: its last error line says why
                row["restart_errors"].append(cause(str(exc)))
        else:
            row.update(restart_s=None, checks={"restarted": False}, passed=False)
            return row, None
        row["checks"] = {"restarted": True, **self.after(server, before, traffic, reference)}
        row["passed"] = all(row["checks"].values())
        return row, server

    def release(self, server: RunningServer) -> dict:
        """What a DP-attention release fixes: the statement and the fingerprint answers."""
        return {"statement": server.get(BUDGET), "answers": fingerprint(server.base, self.model)}

    def after(self, server: RunningServer, before: dict | None, traffic: Load,
              reference: dict | None) -> dict[str, bool]:
        """The checks on the restarted server: the release (DP attention), else accounting and probe."""
        if not self.setup.aggregate:
            return checks.same_release(reference, self.release(server))
        context, per_query = before["contexts"][0]["name"], before["contexts"][0]["per_query"]
        ledger = functools.partial(checks.Ledger.from_statement, context=context)
        seen = [(t, s) for t, s in traffic.budgets if t < traffic.killed_at]
        found = checks.accounting(ledger(before), ledger(server.get(BUDGET)),
                                  (seen[-1][0], ledger(seen[-1][1])) if seen else None, traffic.outcomes,
                                  checks.budget(per_query["worst_case"]), Budget(per_query["min_epsilon"], 0.0))
        status, body = probe(server.base, self.model, self.args.max_tokens)
        return {**found, "probe_answered_or_429": checks.probe_ok(status, body)}


def victim(target: str, api_pid: int) -> int:
    """The pid ``kill -9`` hits for ``target``: the API server, or the engine core among its
    descendants (process title ``ENGINE_TITLE``; RuntimeError when there is none)."""
    if target == API_SERVER:
        return api_pid
    for child in psutil.Process(api_pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # gone since listed
            if child.name() == ENGINE_TITLE or (child.cmdline() or [""])[0].startswith(ENGINE_TITLE):
                return child.pid
    raise RuntimeError(f"no {ENGINE_TITLE} process under the API server {api_pid}")


def cause(error: str) -> str:
    """The last line of a failed start's log tail that names an error (its last line if none)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    named = [line for line in lines if "Error:" in line]
    return (named or lines or [""])[-1][:300]


def counts(outcomes: Sequence[checks.Outcome], aggregate: bool) -> dict:
    """Requests by outcome (``checks.Outcome.kind``); without aggregation (no receipts):
    answered (complete 200s), no response, and rejected (any other status)."""
    out = {"requests": len(outcomes), "streams": sum(o.stream for o in outcomes)}
    if aggregate:
        kinds = [o.kind for o in outcomes]
        return {**out, **{kind: kinds.count(kind) for kind in checks.KINDS}}
    return {**out, **dict.fromkeys(checks.KINDS), checks.NO_RESPONSE: sum(o.status is None for o in outcomes),
            checks.ANSWERED: sum(o.status == 200 and not o.error for o in outcomes),
            checks.REJECTED: sum(o.status not in (None, 200) for o in outcomes)}


def request(aggregate: bool, model: str, text: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    """(path, body) of one load request: a chat question (aggregation) or a completion (DP attention)."""
    if aggregate:
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}],
                                        "max_tokens": max_tokens, "stream": stream}
    return "/v1/completions", {"model": model, "prompt": text, "max_tokens": max_tokens, "stream": stream}


def last_receipt(lines: Sequence[str]) -> dict | None:
    """The ``dp_receipt`` of a server-sent event stream (its last data chunk before ``[DONE]``)."""
    data = [line for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    return json.loads(data[-1][len("data: "):]).get("dp_receipt") if data else None


@dataclass
class Load:
    """``clients`` request loops against ``base``; client i streams when i is odd. ``outcomes``:
    every request sent; ``budgets``: (time sent, statement) of each ``/v1/dp/budget`` answered
    (aggregation); ``killed_at`` and ``in_flight``: the kill's time and the requests in flight then."""

    base: str
    aggregate: bool
    clients: int
    max_tokens: int
    seed: int
    model: str
    outcomes: list[checks.Outcome] = field(default_factory=list)
    budgets: list[tuple[float, dict]] = field(default_factory=list)
    killed_at: float = 0.0
    in_flight: int = 0

    def now(self) -> float:
        return time.monotonic() - self.start

    async def run(self, kill_at: float, kill: Callable[[], None]) -> None:
        """The load until ``kill()``, called ``kill_at`` seconds in; then every loop's last request."""
        self.start, self.stopped = time.monotonic(), asyncio.Event()
        async with httpx.AsyncClient(base_url=self.base, timeout=TIMEOUT) as http:
            loops = [self._client(http, i) for i in range(self.clients)]
            loops += [self._poll(http)] if self.aggregate else []
            task = asyncio.gather(*loops)
            await asyncio.sleep(kill_at - self.now())  # from the start, the client's making included
            self.in_flight = sum(o.in_flight(self.now()) for o in self.outcomes)
            kill()
            self.killed_at = self.now()
            self.stopped.set()
            await task

    async def _client(self, http: httpx.AsyncClient, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while not self.stopped.is_set():
            path, body = request(self.aggregate, self.model, rng.choice(QUESTIONS if self.aggregate else PROMPTS),
                                 self.max_tokens, stream=index % 2 == 1)
            outcome = checks.Outcome(self.now(), body["stream"])
            self.outcomes.append(outcome)
            try:
                await self._send(http, path, body, outcome)
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                outcome.error = type(exc).__name__
                await asyncio.sleep(0.5)  # the server is down: no busy loop until stopped
            outcome.ended = self.now()

    async def _send(self, http: httpx.AsyncClient, path: str, body: dict, outcome: checks.Outcome) -> None:
        if not body["stream"]:
            response = await http.post(path, json=body)
            outcome.status = response.status_code
            if response.status_code == 200:
                outcome.receipt = response.json().get("dp_receipt")
            return
        async with http.stream("POST", path, json=body) as response:
            outcome.status = response.status_code
            lines = [line async for line in response.aiter_lines() if line]
        if response.status_code == 200 and lines and lines[-1] == "data: [DONE]":
            outcome.receipt = last_receipt(lines)

    async def _poll(self, http: httpx.AsyncClient) -> None:
        while not self.stopped.is_set():
            with contextlib.suppress(httpx.HTTPError):
                sent = self.now()  # the statement is read after this: a query ending before did not settle after
                response = await http.get(BUDGET)
                if response.status_code == 200:
                    self.budgets.append((sent, response.json()))
            await asyncio.sleep(0.5)


def fingerprint(base: str, model: str) -> list[dict]:
    """The greedy answers (text, token ids' log-probabilities, top 3) to ``PROMPTS``, one at a
    time (no batching: the engine's rounding does not depend on other requests)."""
    bodies = [{"model": model, "prompt": prompt, "max_tokens": FINGERPRINT_TOKENS, "temperature": 0.0, "logprobs": 3}
              for prompt in PROMPTS]
    with httpx.Client(base_url=base, timeout=TIMEOUT) as http:
        choices = [http.post("/v1/completions", json=body).raise_for_status().json()["choices"][0] for body in bodies]
    return [{"text": choice["text"], "logprobs": choice["logprobs"]} for choice in choices]


def probe(base: str, model: str, max_tokens: int) -> tuple[int | None, dict | None]:
    """The first aggregation query after a restart: (status, body)."""
    path, body = request(True, model, QUESTIONS[0], max_tokens, stream=False)
    try:
        response = httpx.post(base + path, json=body, timeout=TIMEOUT)
        return response.status_code, response.json()
    except httpx.HTTPError:
        return None, None
    except json.JSONDecodeError:
        return response.status_code, None
