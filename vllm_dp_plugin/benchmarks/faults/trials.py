"""One served configuration's trials, chained: the server under load is killed (``kill -9`` of
its API server or its engine core at a seeded random time), restarted on the same configuration,
key and ledgers, checked, and the restarted server carries the next trial's load."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from vllm_dp_plugin.benchmarks.lib.environment import loadavg
from vllm_dp_plugin.benchmarks.lib.vllm import VLLM_DP, RunningServer, engine_flags
from vllm_dp_plugin.privacy.accountant import Budget

from . import checks, load, processes

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
STOP_TIMEOUT = 30.0  # seconds a killed server's survivors get to exit on SIGTERM


@dataclass(frozen=True)
class Setup:
    """A served configuration: ``name``, the example config it copies, the model (None: the
    demo model, made in the run's directory)."""

    name: str
    example: str
    model: str | None
    aggregate: bool


SETUPS = {s.name: s for s in (
    Setup("aggregate", "serve-smollm2-aggregate.yaml", ".models/smollm2-135m-instruct", True),
    Setup("attention-smollm2", "serve-smollm2.yaml", ".models/smollm2-135m-instruct", False),
    Setup("attention-demo", "serve-dp.yaml", None, False),
)}
PATH_KEYS = {"attention": ("private_context", "calibration")}


def write_config(setup: Setup, work: Path, mechanism: str, total_epsilon: float, max_tokens: int) -> Path:
    """The example config with its relative paths resolved and every piece of state in ``work``:
    ``key_file``, ``ledger_file``, ``aggregate.budget_file`` (the demo model's calibration too);
    aggregation with ``mechanism``, ``total_epsilon`` and ``max_tokens``."""
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
        for key in PATH_KEYS["attention"]:
            att[key] = str((EXAMPLES / att[key]).resolve())
        if setup.model is None:
            att["calibration"] = str(work / "calibration.json")
    path = work / "dp.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@dataclass
class Trials:
    """The chained trials of one setup (``run``): its server command, seeded kill times."""

    setup: Setup
    model: str
    config: Path
    work: Path
    clients: int
    max_tokens: int
    kill_min: float
    kill_max: float
    seed: int
    log: object
    max_model_len: int = 2048
    restart_attempts: int = 3

    def __post_init__(self) -> None:
        self.cmd = [*VLLM_DP, "serve", self.model, "--dp-config", str(self.config),
                    *engine_flags(self.model, self.clients + 2, max_model_len=self.max_model_len)]
        self.starts = 0
        self.rng = random.Random(self.seed)

    def start(self) -> tuple[RunningServer, float]:
        """A server started (healthy) and the seconds it took."""
        self.starts += 1
        server = RunningServer(self.cmd, self.work / f"serve-{self.starts}.log", timeout=900,
                               stop_timeout=STOP_TIMEOUT)
        began = time.monotonic()
        server.__enter__()  # chained: the next trial runs on it; stop() closes it
        return server, time.monotonic() - began

    def run(self, targets: tuple[str, ...], trials: int, on_row) -> list[dict]:
        """``trials`` per target, interleaved; ``on_row(rows)`` after each (incremental results)."""
        rows: list[dict] = []
        server, started = self.start()
        self.log(f"{self.setup.name}: first start {started:.0f} s")
        reference = asyncio.run(self.release(server)) if not self.setup.aggregate else None
        try:
            for index in range(trials * len(targets)):
                target = targets[index % len(targets)]
                row, server = self.trial(server, index, target, reference)
                rows.append(row)
                on_row(rows)
                self.log(f"{self.setup.name} #{index} {target}: kill at {row['kill_at_s']:.1f} s, "
                         f"{row['in_flight']} in flight, restart {row['restart_s']} s, "
                         f"{'passed' if row['passed'] else 'FAILED ' + str(row['checks'])}")
                if server is None:
                    break
        finally:
            if server is not None:
                server.stop()
        return rows

    def trial(self, server: RunningServer, index: int, target: str,
              reference: dict | None) -> tuple[dict, RunningServer | None]:
        """One kill and restart; the row and the restarted server (None when it did not start)."""
        kill_at = self.rng.uniform(self.kill_min, self.kill_max)
        before = asyncio.run(self.statement(server)) if self.setup.aggregate else None
        victim = processes.victim(target, server.proc.pid)
        traffic = asyncio.run(self.drive(server, index, kill_at, victim))
        api_exit = processes.wait_exit(server.proc.pid, STOP_TIMEOUT)
        server.stop()
        row = {"setup": self.setup.name, "trial": index, "target": target, "pid": victim,
               "kill_at_s": traffic.killed_at, "in_flight": traffic.in_flight,
               "api_exit_s": api_exit, "loadavg": loadavg(), **traffic.counts(self.setup.aggregate)}
        row["restart_errors"] = []
        for _ in range(self.restart_attempts):
            try:
                server, row["restart_s"] = self.start()
                break
            except RuntimeError as exc:  # the log's tail: its last error line says why
                row["restart_errors"].append(cause(str(exc)))
        else:
            row.update(restart_s=None, checks={"restarted": False}, passed=False)
            return row, None
        row["checks"] = {"restarted": True, **asyncio.run(self.after(server, before, traffic, reference))}
        row["passed"] = all(row["checks"].values())
        return row, server

    async def drive(self, server: RunningServer, index: int, kill_at: float, victim: int) -> Traffic:
        """The load, ``victim`` killed ``kill_at`` seconds in."""
        traffic = load.Load(server.base, "aggregate" if self.setup.aggregate else "attention", self.clients,
                            self.max_tokens, self.seed * 100 + index, self.model)
        task = asyncio.create_task(traffic.run())
        await asyncio.sleep(kill_at)
        in_flight = sum(o.in_flight(traffic.now()) for o in traffic.outcomes)
        processes.kill9(victim)
        killed_at = traffic.now()
        traffic.stop()
        await task
        return Traffic(traffic, killed_at, in_flight)

    async def statement(self, server: RunningServer) -> dict:
        return await asyncio.to_thread(server.get, "/v1/dp/budget")

    async def release(self, server: RunningServer) -> dict:
        """What a DP-attention release fixes: the statement and the fingerprint answers."""
        return {"statement": await self.statement(server), "answers": await load.fingerprint(server.base, self.model)}

    async def after(self, server: RunningServer, before: dict | None, traffic: Traffic,
                    reference: dict | None) -> dict[str, bool]:
        if not self.setup.aggregate:
            return checks.same_release(reference, await self.release(server))
        context = before["contexts"][0]["name"]
        worst = before["contexts"][0]["per_query"]["worst_case"]
        least = Budget(before["contexts"][0]["per_query"]["min_epsilon"], 0.0)
        seen_at = [t for t, s in traffic.record.budgets if t < traffic.killed_at]
        seen = [s for t, s in traffic.record.budgets if t < traffic.killed_at]
        after = checks.Ledger.from_statement(await self.statement(server), context)
        found = checks.accounting(checks.Ledger.from_statement(before, context), after,
                                  (seen_at[-1], checks.Ledger.from_statement(seen[-1], context)) if seen else None,
                                  traffic.record.outcomes, Budget(worst["epsilon"], worst["delta"]), least)
        status, body = await load.probe(server.base, self.model, self.max_tokens)
        return {**found, "probe_answered_or_429": checks.probe_ok(status, body)}


def cause(error: str) -> str:
    """The last line of a failed start's log tail that names an error (its last line if none)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    named = [line for line in lines if "Error:" in line]
    return (named or lines or [""])[-1][:300]


@dataclass
class Traffic:
    """A trial's load as it ended: its outcomes and budget polls, the kill time and the
    requests in flight then."""

    record: load.Load
    killed_at: float
    in_flight: int

    def counts(self, aggregate: bool) -> dict:
        """Requests by outcome (``checks.Outcome.kind``); without aggregation (no receipts):
        answered (complete 200s), no response, and rejected (any other status)."""
        outcomes = self.record.outcomes
        out = {"requests": len(outcomes), "streams": sum(o.stream for o in outcomes)}
        if aggregate:
            kinds = [o.kind for o in outcomes]
            return {**out, **{kind: kinds.count(kind) for kind in (checks.ANSWERED, checks.RESERVED, checks.REFUSED,
                                                                    checks.NO_RESPONSE, checks.REJECTED)}}
        return {**out, checks.ANSWERED: sum(o.status == 200 and not o.error for o in outcomes),
                checks.RESERVED: None, checks.REFUSED: None, checks.NO_RESPONSE: sum(o.status is None for o in outcomes),
                checks.REJECTED: sum(o.status not in (None, 200) for o in outcomes)}
