"""Budget ledger speed: one query's reserve + settle on a ledger already holding N entries, in SQLite (the
embedded default) and PostgreSQL (a temporary local server, unix socket, fsync on); the repository's
``python -m benchmarks.ledger_jsonl`` adds the JSONL + flock ledger they replaced (``OPENERS``).

An entry is one event: a query's reservation or its settlement, so N entries are N/2
settled queries on one context (what ``--entries`` fills before timing). Per backend and N: ``open_s``,
a new ledger object's first call (a server's start-up: the JSONL ledger parses the whole file there),
then ``--pairs`` reserve + settle pairs timed one by one (median and p99, ms). Target: SQLite reserve +
settle <= 1 ms at 1M entries. A reservation waits for the disk (SQLite ``synchronous=FULL``;
PostgreSQL's WAL flush; the JSONL ledger fsyncs both lines); a settlement, which only gives budget back,
does not (``ledger_store``: ``durable=False``), so the figures are this disk's fsync plus the work: the
result file states the load average and a raw fsync's median. ``sqlite-normal`` (``synchronous=NORMAL``
for the reservation too: not what serving uses) isolates the ledger's own work.

``--replicas N --model M``: also N ``vllm-dp serve`` processes on one PostgreSQL ledger, queried at
once until the collection's total is spent: none may grant more. Writes ``ledger-<device>-<date>.{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib import cli
from vllm_dp_plugin.benchmarks.lib.environment import device_label, environment, loadavg
from vllm_dp_plugin.benchmarks.lib.postgres import temporary_postgres, unavailable_reason
from vllm_dp_plugin.benchmarks.lib.progress import logger
from vllm_dp_plugin.benchmarks.lib.report import fmt, suffixed, table, write_json, write_text
from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
from vllm_dp_plugin.privacy.ledger_store import LedgerStore, SQLiteStore, open_store
from vllm_dp_plugin.privacy.query_ledger import QueryLedger

BACKENDS = ("sqlite", "sqlite-normal", "postgresql")
# more backends, registered by name: (key, work directory, entries) -> a filled ledger's opener
OPENERS: dict[str, Callable[[NoiseKey, Path, int], Callable[[], QueryLedger]]] = {}
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


def timed_ms(call, repeats: int, before=lambda: None) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``call`` (``before()`` runs untimed first), sorted."""
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)


def time_pairs(make_ledger, pairs: int) -> dict:
    """A new ledger's first call (``open_s``), then ``pairs`` reserve + settle pairs (ms)."""
    start = time.perf_counter()
    ledger = make_ledger()
    before = ledger.status(CONTEXT, TOTAL)
    opened = time.perf_counter() - start
    times = timed_ms(lambda: ledger.settle(ledger.reserve(CONTEXT, TOTAL, AMOUNT), SETTLED), pairs)
    assert ledger.status(CONTEXT, TOTAL).queries == before.queries + pairs, "the ledger lost a query"
    p99 = times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)]
    return {"open_s": opened, "pair_ms_median": statistics.median(times), "pair_ms_p99": p99,
            "queries_before": before.queries}


def measure(backend: str, entries: int, pairs: int, work: Path, postgres_url: str | None) -> dict:
    """``backend`` filled with ``entries`` entries, then ``time_pairs``."""
    key, queries = NoiseKey(work / "noise.key"), entries // 2
    if backend in OPENERS:
        return time_pairs(OPENERS[backend](key, work, entries), pairs)
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
    try:
        return statistics.median(timed_ms(lambda: os.fsync(fd), repeats, lambda: os.write(fd, b"x" * 128)))
    finally:
        os.close(fd)
        path.unlink()


REPLICA_DOCS = ("The Harlow depot opens at 6 am.", "Harlow's depot opens at six in the morning.",
                "Depot hours at Harlow: from 6 am.", "The depot in Harlow closes at 10 pm.")


def replicas(model: str, count: int, clients: int, queries: int, work: Path, url: str, log) -> dict:
    """``count`` servers on one PostgreSQL ledger, ``queries`` queries of eps 1 at once (``clients`` threads,
    round-robin) on a collection whose total pays for half: how many were granted, what was spent."""
    import concurrent.futures
    import urllib.error
    import urllib.request

    from vllm_dp_plugin.benchmarks.lib.vllm import ENGINE_FLAGS, RunningServer, with_env

    docs, config, total = work / "replica-docs.jsonl", work / "replicas.json", queries // 2
    docs.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(REPLICA_DOCS)))
    config.write_text(json.dumps({"dp_privacy": {
        "key_file": str(work / "noise.key"), "ledger": url,
        "aggregate": {"contexts": {"harlow": str(docs)}, "members": 2, "epsilon": 1.0, "min_epsilon": 1.0,
                      "total_epsilon": float(total), "max_tokens": 2}}}))
    cmd = [str(Path(sys.executable).with_name("vllm-dp")), "serve", model, "--dp-config", str(config),
           *ENGINE_FLAGS, "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20)]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "When does the depot open?"}],
                       "max_tokens": 2}).encode()

    def ask(base: str) -> tuple[int, dict | None]:
        request = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return response.status, json.loads(response.read()).get("dp_receipt")
        except urllib.error.HTTPError as exc:
            return exc.code, None

    with contextlib.ExitStack() as stack:
        servers = []
        for i in range(count):
            log(f"ledger bench: starting replica {i + 1} of {count}")
            servers.append(stack.enter_context(RunningServer(cmd, work / f"replica-{i}.log",
                                                             with_env({"VLLM_PLUGINS": None}))))
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(ask, [servers[i % count].base for i in range(queries)]))
        spent = [s.get("/v1/dp/budget")["contexts"][0]["ledger"]["spent"]["epsilon"] for s in servers]
    receipts = [r["epsilon"] for status, r in answers if status == 200]
    return {"replicas": count, "queries": queries, "total_epsilon": float(total),
            "granted": len(receipts), "refused_429": sum(status == 429 for status, _ in answers),
            "other_status": sorted({status for status, _ in answers} - {200, 429}),
            "spent_per_server": spent, "receipts_sum": math.fsum(receipts),
            "within_total": all(x <= total * (1 + 1e-9) for x in [*spent, math.fsum(receipts)])}


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    cli.add_date_arg(cli.add_quick_arg(cli.add_out_arg(parser), "2,000 entries, 50 pairs (seconds)"))
    parser.add_argument("--entries", type=cli.ints, help="ledger sizes before timing (default 1000,100000,1000000)")
    parser.add_argument("--pairs", type=int, default=200, help="reserve + settle pairs timed per size (default 200)")
    backends = (*BACKENDS, *OPENERS)
    parser.add_argument("--backends", type=cli.names, default=backends, help=f"of {','.join(backends)} (default all)")
    parser.add_argument("--work", type=Path, help="where the ledgers are written (default a temporary directory)")
    parser.add_argument("--replicas", type=int, default=0, help="vllm-dp serve processes on one PostgreSQL ledger "
                        "(default 0: not run; needs --model)")
    parser.add_argument("--model", help="the model the replicas serve (e.g. .models/smollm2-135m-instruct)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients of the replicas (default 16)")
    parser.add_argument("--queries", type=int, default=40, help="queries sent to the replicas (default 40)")
    return parser


def build_parser(prog: str = "vllm-dp bench ledger") -> argparse.ArgumentParser:
    """The suite's parser; ``command``: the command its result files state."""
    parser = add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0]))
    parser.set_defaults(command=prog)
    return parser


def main(args: argparse.Namespace | Sequence[str] | None = None, build=build_parser) -> int:
    """Time every backend at every size (and the replicas, if asked), then write the result files."""
    args, argv = cli.parse(args, build)
    entries = args.entries or ((2000,) if args.quick else (1000, 100_000, 1_000_000))
    pairs = 50 if args.quick else args.pairs
    unknown = set(args.backends) - {*BACKENDS, *OPENERS}
    if unknown:
        raise SystemExit(f"--backends: unknown {sorted(unknown)}; use {','.join((*BACKENDS, *OPENERS))}")
    reason = unavailable_reason() if "postgresql" in args.backends else None
    skipped = {"postgresql": reason} if reason else {}
    if args.replicas and not args.model:
        raise SystemExit("--replicas needs --model")
    rows, log, shared = [], logger(True, sys.stderr), None
    with contextlib.ExitStack() as stack:
        wants_pg = not reason and ("postgresql" in args.backends or args.replicas)
        url = stack.enter_context(temporary_postgres()) if wants_pg else None
        work = Path(args.work or stack.enter_context(tempfile.TemporaryDirectory(prefix="vllm-dp-ledger-",
                                                                                 dir=os.getcwd())))
        for n in entries:
            for backend in [b for b in args.backends if b not in skipped]:
                log(f"ledger bench: {backend} at {n} entries")
                rows.append({"backend": backend, "entries": n, **measure(backend, n, pairs, work, url),
                             "fsync_ms": fsync_ms(work), "loadavg": loadavg()})
        if args.replicas:
            if url is None:
                raise SystemExit(f"--replicas needs PostgreSQL: {reason}")
            shared = replicas(args.model, args.replicas, args.clients, args.queries, work,
                              f"{url}&options=-csearch_path%3Dpublic", log)
    write(args, argv, rows, skipped, shared)
    return 0


def write(args, argv, rows: list[dict], skipped: dict, shared: dict | None) -> None:
    """``ledger-<device>-<date>.{md,json}`` in ``args.out``; the markdown is printed too."""
    stem = args.out / f"ledger-{device_label('cpu', short=True)}-{cli.today(args.date)}"
    head = ["backend", "entries", "open (s)", "reserve+settle median (ms)", "p99 (ms)", "raw fsync (ms)", "load avg"]
    body = [[r["backend"], r["entries"], r["open_s"], r["pair_ms_median"], r["pair_ms_p99"], r["fsync_ms"],
             r["loadavg"][0] if r["loadavg"] else None] for r in rows]  # table() formats the numbers
    biggest = max((r for r in rows if r["backend"] == "sqlite"), key=lambda r: r["entries"], default=None)
    verdict = ("n/a (no sqlite row)" if biggest is None else
               f"{'PASS' if biggest['pair_ms_median'] <= TARGET_MS else 'FAIL'}: SQLite reserve+settle median "
               f"{fmt(biggest['pair_ms_median'])} ms at {biggest['entries']} entries (target <= {TARGET_MS:g} ms)")
    env = environment("cpu", ())
    text = "\n".join([
        "# Budget ledger: reserve + settle at N entries", "",
        f"Command: `{cli.command_line(args.command, argv)}`", "",
        __doc__.split("\n\n")[1].replace("\n", " "), "",
        table(head, body), "",
        f"Target: {verdict}.",
        *(f"Skipped {name}: {why}." for name, why in skipped.items()), "",
        *([] if shared is None else [
            f"## {shared['replicas']} `vllm-dp serve` processes on one PostgreSQL ledger", "",
            (f"{shared['queries']} queries (eps 1 each) at once against a collection whose total is "
             f"{shared['total_epsilon']:g}: {shared['granted']} granted, {shared['refused_429']} refused with "
             f"429{', other statuses ' + str(shared['other_status']) if shared['other_status'] else ''}; spent per "
             f"server's /v1/dp/budget {shared['spent_per_server']}, receipts delivered sum to "
             f"{shared['receipts_sum']:g}: {'within' if shared['within_total'] else 'OVER'} the total."), ""]),
        "Environment: " + json.dumps(env), "",
    ])
    write_text(suffixed(stem, ".md"), text)
    write_json(suffixed(stem, ".json"), {"rows": rows, "skipped": skipped, "target_ms": TARGET_MS, "replicas": shared,
                                         "environment": env})
    print(text)
