"""``python -m benchmarks.ledger_jsonl``: ``vllm-dp bench ledger`` with the JSONL + flock ledger that
SQLite replaced beside SQLite and PostgreSQL, its ``QueryLedger`` loaded from git revision
``--jsonl-rev`` (a checkout of this repository only), filled with the same history as it wrote it."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks import with_example
from vllm_dp_plugin.benchmarks import ledger
from vllm_dp_plugin.benchmarks.lib.cli import parse
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey

JSONL_REV = "d316805"  # the last revision whose QueryLedger is the JSONL + flock file


def fill_jsonl(path: Path, key: NoiseKey, queries: int) -> None:
    """The same history as the JSONL ledger wrote it: a reserve and a settle line per query."""
    common = {"key": key.label("query-ledger/key"), "context": key.label("query-ledger/context", ledger.CONTEXT),
              "total_epsilon": ledger.TOTAL.epsilon, "total_delta": ledger.TOTAL.delta, "client": ""}
    with open(path, "w") as out:
        for i in range(queries):
            for kind, amount, when in (("reserve", ledger.AMOUNT, 1.0), ("settle", ledger.SETTLED, 2.0)):
                line = {**common, "kind": kind, "id": f"{i:032x}", "epsilon": amount.epsilon, "delta": amount.delta,
                        "time": when}
                out.write(json.dumps(line, sort_keys=True, separators=(",", ":")) + "\n")


def jsonl_ledger_class(rev: str):
    """``QueryLedger`` as of git revision ``rev`` (the JSONL + flock file), imported from ``git show``."""
    source = subprocess.run(["git", "show", f"{rev}:vllm_dp_plugin/privacy/query_ledger.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="vllm-dp-jsonl-")) / "jsonl_query_ledger.py"
    path.write_text(source.replace("from .", "from vllm_dp_plugin.privacy."))
    spec = importlib.util.spec_from_file_location("jsonl_query_ledger", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.QueryLedger


def jsonl_opener(rev: str) -> Callable[[NoiseKey, Path, int], Callable]:
    """``ledger.OPENERS``' entry: the JSONL file of ``entries`` entries in ``work``, then its opener."""
    cls = jsonl_ledger_class(rev)

    def filled(key: NoiseKey, work: Path, entries: int) -> Callable:
        path = work / f"queries-{entries}.jsonl"
        fill_jsonl(path, key, entries // 2)
        return lambda: cls(key, path)

    return filled


@with_example
def build_parser(prog: str = "python -m benchmarks.ledger_jsonl") -> argparse.ArgumentParser:
    parser = ledger.build_parser(prog)
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--jsonl-rev", default=JSONL_REV, help=f"git revision of the JSONL ledger (default {JSONL_REV})")
    parser.set_defaults(backends=(*ledger.BACKENDS, "jsonl"))
    return parser


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    parsed, argv = parse(args, build_parser)
    if "jsonl" in parsed.backends:
        ledger.OPENERS["jsonl"] = jsonl_opener(parsed.jsonl_rev)
    return ledger.main(parsed if argv is None else argv, build=build_parser)


if __name__ == "__main__":
    raise SystemExit(main())
