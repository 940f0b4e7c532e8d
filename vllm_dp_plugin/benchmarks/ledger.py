"""Budget ledger speed: one query's reserve + settle on a ledger already holding N entries, in
SQLite (the embedded default), PostgreSQL (a temporary local server, unix socket, fsync on) and
the JSONL + flock ledger they replaced (loaded from the git revision ``--jsonl-rev``).

An entry is one event of the JSONL ledger: a query's reservation or its settlement, so N entries
are N/2 settled queries on one context (what ``--entries`` fills before timing). Per backend and
N: ``open_s``, a new ledger object's first call (a server's start-up: the JSONL ledger parses
the whole file there), then ``--pairs`` reserve + settle pairs timed one by one (median and
p99, ms). Target: SQLite reserve + settle <= 1 ms at 1M entries. Every commit waits for the
disk (SQLite ``synchronous=FULL``; the JSONL ledger's fsync; PostgreSQL's WAL flush), so the
figures are this disk's fsync plus the work: the result file states the load average and a raw
fsync's median. ``sqlite-normal`` (``synchronous=NORMAL``, no fsync per commit: not what serving
uses) isolates the ledger's own work.

Writes ``ledger-<device>-<date>.md`` and ``.json`` into ``--out``. ``--quick``: 2,000 entries.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.cli import (
    add_date_arg,
    add_out_arg,
    add_quick_arg,
    command_line,
    ints,
    names,
    parse,
    today,
)
from vllm_dp_plugin.benchmarks.lib.environment import device_label, environment, loadavg
from vllm_dp_plugin.benchmarks.lib.postgres import temporary_postgres, unavailable_reason
from vllm_dp_plugin.benchmarks.lib.progress import logger
from vllm_dp_plugin.benchmarks.lib.report import fmt, suffixed, table, write_json, write_text
from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
from vllm_dp_plugin.privacy.ledger_store import LedgerStore, SQLiteStore, open_store
from vllm_dp_plugin.privacy.query_ledger import QueryLedger

BACKENDS = ("sqlite", "sqlite-normal", "postgresql", "jsonl")
JSONL_REV = "d316805"  # the last revision whose QueryLedger is the JSONL + flock file
CONTEXT = "bench"
AMOUNT, SETTLED = Budget(0.01, 1e-9), Budget(0.005, 0.0)
TOTAL = Budget(1e12, 0.5)  # never the limit: the cost of a grant is timed, not a refusal
TARGET_MS = 1.0
BATCH = 20_000  # rows per executemany while filling


def fill_store(store: LedgerStore, key: NoiseKey, queries: int) -> None:
    """``queries`` settled reservations on ``CONTEXT`` and their running total, written in bulk."""
    key_label, context = key.label("query-ledger/key"), key.label("query-ledger/context", CONTEXT)
    with store.transaction(write=True) as tx:
        for start in range(0, queries, BATCH):
            rows = [(f"{i:032x}", key_label, context, "", AMOUNT.epsilon, AMOUNT.delta, TOTAL.epsilon, TOTAL.delta,
                     1.0, SETTLED.epsilon, SETTLED.delta, 2.0) for i in range(start, min(queries, start + BATCH))]
            tx.executemany("INSERT INTO query_reservations (id, key, context, client, epsilon, delta, total_epsilon, "
                           "total_delta, reserved_at, settled_epsilon, settled_delta, settled_at) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        spent = Budget(math.fsum([SETTLED.epsilon] * queries), math.fsum([SETTLED.delta] * queries))
        tx.execute("INSERT INTO query_totals VALUES (?, ?, '', ?, 0, ?, 0, ?)",
                   (key_label, context, spent.epsilon, spent.delta, queries))
        tx.execute("INSERT INTO ledger_keys VALUES ('query', ?, ?)", (key_label, queries))


def fill_jsonl(path: Path, key: NoiseKey, queries: int) -> None:
    """The same history as the JSONL ledger wrote it: a reserve and a settle line per query."""
    common = {"key": key.label("query-ledger/key"), "context": key.label("query-ledger/context", CONTEXT),
              "total_epsilon": TOTAL.epsilon, "total_delta": TOTAL.delta, "client": ""}
    with open(path, "w") as out:
        for i in range(queries):
            out.writelines(json.dumps({**common, "kind": kind, "id": f"{i:032x}", "epsilon": amount.epsilon,
                                      "delta": amount.delta, "time": when}, sort_keys=True,
                                     separators=(",", ":")) + "\n" for kind, amount, when in (("reserve", AMOUNT, 1.0), ("settle", SETTLED, 2.0)))


def jsonl_ledger_class(rev: str):
    """``QueryLedger`` as of git revision ``rev`` (the JSONL + flock file), imported from ``git show``."""
    source = subprocess.run(["git", "show", f"{rev}:vllm_dp_plugin/privacy/query_ledger.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="vllm-dp-jsonl-")) / "jsonl_query_ledger.py"
    path.write_text(source.replace("from .", "from vllm_dp_plugin.privacy."))
    spec = importlib.util.spec_from_file_location("jsonl_query_ledger", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.QueryLedger


def time_pairs(make_ledger, pairs: int) -> dict:
    """A new ledger's first call (``open_s``), then ``pairs`` reserve + settle pairs (ms)."""
    start = time.perf_counter()
    ledger = make_ledger()
    before = ledger.status(CONTEXT, TOTAL)
    opened = time.perf_counter() - start
    times = []
    for _ in range(pairs):
        start = time.perf_counter()
        ledger.settle(ledger.reserve(CONTEXT, TOTAL, AMOUNT), SETTLED)
        times.append((time.perf_counter() - start) * 1e3)
    after = ledger.status(CONTEXT, TOTAL)
    assert after.queries == before.queries + pairs, "the ledger lost a query"
    times.sort()
    return {"open_s": opened, "pair_ms_median": statistics.median(times),
            "pair_ms_p99": times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)],
            "queries_before": before.queries}


def measure(backend: str, entries: int, pairs: int, work: Path, postgres_url: str | None, jsonl_cls) -> dict:
    key = NoiseKey(work / "noise.key")
    queries = entries // 2
    if backend == "jsonl":
        path = work / f"queries-{entries}.jsonl"
        fill_jsonl(path, key, queries)
        return time_pairs(lambda: jsonl_cls(key, path), pairs)
    if backend.startswith("sqlite"):
        location = str(work / f"ledger-{entries}-{backend}.sqlite")
    else:
        location = f"{postgres_url}&options=-csearch_path%3Dn{entries}"
        import psycopg

        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA n{entries}")
    store = open_store(location)
    fill_store(store, key, queries)
    store.close()
    if backend == "sqlite-normal":
        return time_pairs(lambda: QueryLedger(key, SQLiteStore(location, synchronous="NORMAL")), pairs)
    return time_pairs(lambda: QueryLedger(key, location), pairs)


def fsync_ms(directory: Path, repeats: int = 50) -> float:
    """The median time of one fsync of a small append in ``directory`` (the disk's floor)."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    times = []
    try:
        for _ in range(repeats):
            os.write(fd, b"x" * 128)
            start = time.perf_counter()
            os.fsync(fd)
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(times)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_out_arg(parser)
    add_quick_arg(parser, "2,000 entries, 50 pairs (seconds)")
    add_date_arg(parser)
    parser.add_argument("--entries", type=ints, help="ledger sizes before timing (default 1000,100000,1000000)")
    parser.add_argument("--pairs", type=int, default=200, help="reserve + settle pairs timed per size (default 200)")
    parser.add_argument("--backends", type=names, default=BACKENDS, help=f"of {','.join(BACKENDS)} (default all)")
    parser.add_argument("--jsonl-rev", default=JSONL_REV, help=f"git revision of the JSONL ledger (default {JSONL_REV})")
    parser.add_argument("--work", type=Path, help="where the ledgers are written (default a temporary directory)")
    return parser


def build_parser() -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog="vllm-dp bench ledger", description=__doc__.split("\n\n")[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    args, argv = parse(args, build_parser)
    entries = args.entries or ((2000,) if args.quick else (1000, 100_000, 1_000_000))
    pairs = 50 if args.quick else args.pairs
    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        raise SystemExit(f"--backends: unknown {sorted(unknown)}; use {','.join(BACKENDS)}")
    skipped = {}
    reason = unavailable_reason() if "postgresql" in args.backends else None
    if reason:
        skipped["postgresql"] = reason
    jsonl_cls = jsonl_ledger_class(args.jsonl_rev) if "jsonl" in args.backends else None
    rows, log = [], logger(True, sys.stderr)
    with contextlib.ExitStack() as stack:
        url = None if reason or "postgresql" not in args.backends else stack.enter_context(temporary_postgres())
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vllm-dp-ledger-",
                                                                                 dir=os.getcwd())))
        for n in entries:
            for backend in args.backends:
                if backend in skipped:
                    continue
                log(f"ledger bench: {backend} at {n} entries")
                rows.append({"backend": backend, "entries": n, **measure(backend, n, pairs, Path(work), url, jsonl_cls),
                             "fsync_ms": fsync_ms(Path(work)), "loadavg": loadavg()})
    write(args, argv, rows, skipped)
    return 0


def write(args, argv, rows: list[dict], skipped: dict) -> None:
    stem = args.out / f"ledger-{device_label('cpu', short=True)}-{today(args.date)}"
    head = ["backend", "entries", "open (s)", "reserve+settle median (ms)", "p99 (ms)", "raw fsync (ms)", "load avg"]
    body = [[r["backend"], r["entries"], fmt(r["open_s"]), fmt(r["pair_ms_median"]), fmt(r["pair_ms_p99"]),
             fmt(r["fsync_ms"]), fmt(r["loadavg"][0] if r["loadavg"] else None)] for r in rows]
    biggest = max((r for r in rows if r["backend"] == "sqlite"), key=lambda r: r["entries"], default=None)
    verdict = ("n/a (no sqlite row)" if biggest is None else
               f"{'PASS' if biggest['pair_ms_median'] <= TARGET_MS else 'FAIL'}: SQLite reserve+settle median "
               f"{fmt(biggest['pair_ms_median'])} ms at {biggest['entries']} entries (target <= {TARGET_MS:g} ms)")
    text = "\n".join([
        "# Budget ledger: reserve + settle at N entries", "",
        f"Command: `{command_line('vllm-dp bench ledger', argv)}`", "",
        __doc__.split("\n\n")[1].replace("\n", " "), "",
        table(head, body), "",
        f"Target: {verdict}.",
        *(f"Skipped {name}: {why}." for name, why in skipped.items()), "",
        "Environment: " + json.dumps(environment("cpu", ())), "",
    ])
    write_text(suffixed(stem, ".md"), text)
    write_json(suffixed(stem, ".json"), {"rows": rows, "skipped": skipped, "target_ms": TARGET_MS,
                                         "environment": environment("cpu", ())})
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())
