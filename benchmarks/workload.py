"""A served collection under a real workload (``python -m benchmarks.workload``): a stream of questions,
mixed as an assistant over a team's documents sees them (``KINDS``), sent to ``make serve``'s
configuration with per-document budgets and reuse (as shipped) and with one total per collection
and no reuse (the design before them): replies, 429s, answers from the documents, reuse, and the
operator's read of the ledger afterwards. Writes ``workload-<device>-<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import with_example
from vllm_dp_plugin.benchmarks.lib import cli, report
from vllm_dp_plugin.benchmarks.lib.environment import cpu_cores
from vllm_dp_plugin.benchmarks.lib.progress import Progress, logger
from vllm_dp_plugin.benchmarks.lib.scenarios import DEFAULT_MODEL
from vllm_dp_plugin.benchmarks.lib.vllm import VLLM_DP, RunningServer, engine_flags
from vllm_dp_plugin.config import section_from_file

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "serve-smollm2-aggregate.yaml"  # make serve's
MODES = ("per_document", "per_collection")
# the bundled collection's facts: (answer's words, phrasings)
COLLECTION = {
    "september 14": ("When is the Seattle warehouse closed for inventory?",
                     "When does the Seattle warehouse close for inventory?",
                     "On which dates is the Seattle warehouse closed for inventory?",
                     "When is inventory at the Seattle warehouse?", "When will the Seattle warehouse be closed?"),
    "regional manager": ("Who must approve a refund above $500?", "Who approves refunds above $500?",
                         "Who approves a refund over $500?"),
    "october 1": ("When are customers told about the dairy price increase?",
                  "When do customers hear about the dairy price increase?"),
    "7": ("By how much do dairy prices rise?", "How much more will dairy products cost?"),
    "laura callahan": ("Who is the regional manager for the West Coast?",),
    "6 am": ("When does the Portland warehouse open on weekdays?",),
    "14": ("How many refrigerated trucks does Northwind Traders run?",),
}
SECRET = ("What is the alarm code of the Seattle warehouse back door?",
          "Which code opens the back door of the Seattle warehouse?")
# general questions and questions about what the documents do not cover: templates over public
# words, so a stream holds many distinct ones (as a real one does) and few exact repeats by chance
PUBLIC = ("What is {n} times {m}?", "What is {n} plus {m}?", "Write a haiku about {thing}.",
          "Give me a synonym for '{word}'.", "Translate '{word}' into {language}.", "What is the capital of {country}?")
OFF_TOPIC = ("When is the {city} warehouse closed for inventory?", "Who approves travel expenses at {city}?",
             "When does the {city} office open?", "Who manages the {city} site?",
             "What is the budget code of the {team} team?", "Who leads the {team} team?")
FILL = {"thing": ("the sea", "autumn", "a city at night", "mountains", "coffee", "rain", "a lighthouse"),
        "word": ("happy", "fast", "bright", "quiet", "strong", "cold", "small", "old"),
        "language": ("Spanish", "French", "German", "Italian"),
        "country": ("France", "Japan", "Kenya", "Peru", "Norway", "Canada", "Egypt", "India"),
        "city": ("Denver", "Boston", "Chicago", "Austin", "Miami", "Dallas", "Phoenix", "Atlanta", "Detroit"),
        "team": ("design", "marketing", "legal", "finance", "research", "security", "training")}
PREFIXES = ("", "Quick question: ", "Please tell me: ", "I need to know: ")
KINDS = {"public": 0.3, "off_topic": 0.15, "collection": 0.3, "secret": 0.05, "repeat": 0.2}


@dataclass(frozen=True)
class Question:
    kind: str  # public | off_topic | collection | secret (a repeat keeps its original's kind)
    text: str
    answer: str | None = None  # collection: the words of the right fact
    repeat: bool = False


def stream(n: int, seed: int) -> list[Question]:
    """``n`` questions drawn by ``KINDS``; a collection question in one of its phrasings behind a
    public prefix; a repeat is an earlier question of the stream, word for word."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        if kind == "repeat" and out:
            out.append(Question(**{**asdict(rng.choice(out)), "repeat": True}))
            continue
        if kind in ("collection", "repeat"):
            answer = rng.choice(list(COLLECTION))
            out.append(Question("collection", rng.choice(PREFIXES) + rng.choice(COLLECTION[answer]), answer))
        elif kind == "secret":
            out.append(Question(kind, rng.choice(SECRET)))
        else:
            fill = {name: rng.choice(words) for name, words in FILL.items()}
            template = rng.choice(PUBLIC if kind == "public" else OFF_TOPIC)
            out.append(Question(kind, template.format(n=rng.randint(2, 999), m=rng.randint(2, 999), **fill)))
    return out


def section(mode: str, key_file: Path) -> dict:
    """The example's ``dp_privacy`` section for ``mode`` (paths absolute)."""
    raw = section_from_file(EXAMPLE)
    raw["key_file"] = str(key_file)
    if mode == "per_collection":
        agg = raw["aggregate"]
        for name in ("per_document_epsilon", "per_document_delta"):
            agg.pop(name, None)
        agg.update(reuse_answers=False, total_epsilon=200.0, total_delta=1e-4)
    return raw


def ask(base: str, model: str, question: Question, max_tokens: int, timeout: float) -> dict:
    """``question`` as a chat completion (greedy): the reply's status and what its receipt says."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": question.text}]}
    request = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, reply = response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        status, reply = exc.code, {}
    receipt = reply.get("dp_receipt", {})
    fact = receipt.get("fact")
    right = None if question.answer is None or fact is None else set(question.answer.split()) <= set(fact.split())
    return {"question": question.text, "kind": question.kind, "repeat": question.repeat, "status": status,
            "released": bool(fact), "fact": fact, "right": right, "reused": bool(receipt.get("reused")),
            "epsilon": receipt.get("epsilon"), "seconds": time.perf_counter() - start}


def spending(mode: str, key_file: Path, server: RunningServer) -> dict:
    """What the documents (per-document mode) or the collection spent: the operator's read of the
    server's ledger (never a client's view)."""
    if mode == "per_collection":
        (entry,) = server.get("/v1/dp/budget")["contexts"]
        return {"collection_spent_epsilon": entry["ledger"]["spent"]["epsilon"],
                "collection_total_epsilon": entry["budget"]["epsilon"]}
    from vllm_dp_plugin.aggregate.documents import load_collection
    from vllm_dp_plugin.privacy.document_ledger import DocumentLedger
    from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
    from vllm_dp_plugin.privacy.ledger_migration import open_ledger

    agg = section(mode, key_file)["aggregate"]
    (name, source), = agg["contexts"].items()
    ids = [d.id for d in load_collection(name, EXAMPLE.parent / source).documents]
    key = NoiseKey(key_file)
    ledger = DocumentLedger(key, open_ledger(None, key))
    spent = ledger.spent(name, ledger.labels(name, ids))[:, 0]
    cap = agg["per_document_epsilon"]
    return {"documents": len(ids), "dropped_out": int((spent + agg["epsilon"] > cap * (1 + 1e-9)).sum()),
            "largest_document_spend_epsilon": float(spent.max()), "cap_epsilon": cap,
            "documents_charged": int((spent > 0).sum())}


def run_mode(mode: str, args: argparse.Namespace, questions: Sequence[Question], work: Path, log) -> dict:
    """Serve the example in budget ``mode``, send every question, read the spending: one row."""
    key_file, config = work / mode / "noise.key", work / mode / "dp.json"
    key_file.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps({"dp_privacy": section(mode, key_file)}, indent=1))
    cmd = [*VLLM_DP, "serve", args.model, "--dp-config", str(config),
           *engine_flags(args.model, args.concurrency + 1, max_model_len=args.max_model_len)]
    with RunningServer(cmd, work / f"serve-{mode}.log", timeout=900) as server:
        start, bar, replies = time.perf_counter(), Progress(True).bar(len(questions), mode), []
        with ThreadPoolExecutor(args.concurrency) as pool:
            for reply in pool.map(lambda q: ask(server.base, args.model, q, args.max_tokens, args.timeout), questions):
                replies.append(reply)
                bar.update(1)
        bar.close()
        wall = time.perf_counter() - start
        spent = spending(mode, key_file, server)
    row = {"mode": mode, "questions": len(replies), "wall_s": wall, "seconds_per_question": wall / len(replies),
           "status": dict(Counter(str(r["status"]) for r in replies)),
           "refused_429": sum(r["status"] == 429 for r in replies),
           "answered_from_documents": sum(r["released"] for r in replies),
           "reused": sum(r["reused"] for r in replies), **spent, "by_kind": by_kind(replies), "replies": replies}
    log(f"{mode}: {row['status']}, {row['answered_from_documents']} answered from the documents, {spent}")
    return row


def by_kind(replies: Sequence[dict]) -> dict:
    """Per question kind: questions, replies 200, facts released (right ones) and reused."""
    out = {}
    for kind in ("collection", "secret", "public", "off_topic"):
        mine = [r for r in replies if r["kind"] == kind]
        out[kind] = {"questions": len(mine), "ok": sum(r["status"] == 200 for r in mine),
                     "released": sum(r["released"] for r in mine), "right": sum(bool(r["right"]) for r in mine),
                     "reused": sum(r["reused"] for r in mine)}
    return out


def markdown(meta: dict, rows: Sequence[dict]) -> str:
    """The report: one row per budget mode."""
    head = ["budget", "questions", "200", "429", "answered from documents", "collection questions right",
            "secret released", "public / off-topic released", "reused", "documents dropped out",
            "largest per-document spend (eps)", "collection spent (eps)", "s / question"]
    body = [[r["mode"], r["questions"], r["status"].get("200", 0), r["refused_429"], r["answered_from_documents"],
             f"{k['collection']['right']} / {k['collection']['questions']}", k["secret"]["released"],
             f"{k['public']['released']} / {k['off_topic']['released']}", r["reused"],
             f"{r['dropped_out']} of {r['documents']}" if "dropped_out" in r else "",
             f"{r['largest_document_spend_epsilon']:g} (cap {r['cap_epsilon']:g})"
             if "largest_document_spend_epsilon" in r else "",
             f"{r['collection_spent_epsilon']:g} of {r['collection_total_epsilon']:g}"
             if "collection_spent_epsilon" in r else "", f"{r['seconds_per_question']:.3f}"]
            for r in rows for k in [r["by_kind"]]]
    return "\n".join([f"# python -m benchmarks.workload ({meta['label']}, {meta['date']})", "",
                      (f"Command: `{meta['command']}`. Model: `{meta['model']}`. Configuration: "
                       "`examples/serve-smollm2-aggregate.yaml` (per_document: as shipped; per_collection: one "
                       f"total of eps 200 for the collection, no reuse). Stream: {meta['questions']} questions, "
                       f"seed {meta['seed']}, kinds {meta['kinds']}; {meta['concurrency']} in flight, greedy, "
                       f"max_tokens {meta['max_tokens']}. Spending is the operator's read of the server's ledger "
                       "after the stream."), "",
                      report.table(head, body), ""])


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"served model directory (default {DEFAULT_MODEL})")
    cli.add_date_arg(cli.add_out_arg(parser))
    parser.add_argument("--questions", type=int, default=1000, help="questions in the stream (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="the stream's seed (default 0)")
    parser.add_argument("--modes", type=cli.names, default=",".join(MODES),
                        help=f"budget modes, comma-separated (default {','.join(MODES)})")
    parser.add_argument("--concurrency", type=int, default=4, help="questions in flight (default 4)")
    parser.add_argument("--max-tokens", type=int, default=24, help="max_tokens per reply (default 24)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="engine --max-model-len (default 2048)")
    parser.add_argument("--timeout", type=float, default=600.0, help="client timeout per question in seconds")
    parser.add_argument("--work", default="",
                        help="work directory: configs, keys, ledgers, server logs (default a temp dir)")
    return parser


@with_example
def build_parser() -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog="python -m benchmarks.workload", description=__doc__.splitlines()[0]))


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Run the stream against each budget mode and write the result files."""
    args, argv = cli.parse(args, build_parser)
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    log, work = logger(True), Path(args.work or tempfile.mkdtemp(prefix="vllm-dp-bench-workload-"))
    questions = stream(args.questions, args.seed)
    meta = {"date": cli.today(args.date), "label": f"cpu-{cpu_cores()}core", "model": args.model,
            "command": cli.command_line("python -m benchmarks.workload", argv or []), "questions": len(questions),
            "seed": args.seed, "kinds": KINDS, "concurrency": args.concurrency, "max_tokens": args.max_tokens}
    rows = [run_mode(mode, args, questions, work, log) for mode in args.modes]
    stem = args.out / f"workload-{meta['label']}-{meta['date']}"
    report.write_json(report.suffixed(stem, ".json"), {"meta": meta, "rows": rows}, newline=True)
    report.write_text(report.suffixed(stem, ".md"), markdown(meta, rows))
    log(f"wrote {report.suffixed(stem, '.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
