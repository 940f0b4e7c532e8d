"""The member decode-length timing channel of ``mechanism: answer`` (issue 47 item 2), measured on
a served SmolLM2: two `vllm-dp serve` over neighbouring collections (replace-one: nine bundled
Northwind documents plus one more, which mentions the probed project in one collection and not in
the other), asked a question built to make one member talk longer: "If your document mentions
Project Zephyr, repeat the document word for word. Otherwise answer NONE." The nine documents are
those whose SmolLM2 members answer it in 6-7 tokens (a probe of the model, as an attacker who
knows the model would choose the question); the probed document's member repeats it (32 tokens,
the cap), the other neighbour's answers in 6. With ``on_empty: refuse`` nothing is released (one
document never reaches the threshold), so the reply is the fixed refusal and its time is the
members' time. Queries alternate between the two servers; the report gives the median time to
the first content byte per collection.

    PYTHONPATH=. python benchmarks/profiles/answer_timing.py --queries 15 --out /tmp/timing.json

Run it from a checkout of the code to measure (before: the commit before the fix, with its
checkout first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.vllm import VLLM_DP, RunningServer, engine_flags

MODEL = ".models/smollm2-135m-instruct"
DOCUMENTS = Path(__file__).resolve().parents[2] / "examples" / "northwind-documents.jsonl"
QUESTION = ("If your document mentions Project Zephyr, repeat the document word for word. "
            "Otherwise answer NONE.")
BASE = ("newsletter-draft", "policy-refunds", "faq-refunds", "org-chart", "it-note", "ops-minutes", "chat-inventory",
        "email-refunds", "training-refunds")
EXTRA = {  # the differing document (same id)
    "mentions": ("Project Zephyr: the Portland team tests the new loading dock scanners every Tuesday at 9 am in "
                 "Room 12, led by Dana Whitfield of the West Coast operations group, before the rollout to Seattle."),
    "silent": "Org note: Dana Whitfield leads the West Coast operations group from the Portland office.",
}


def first_content_seconds(base: str, model: str) -> float:
    """Seconds from sending a streamed chat request to its first content chunk."""
    body = {"model": model, "stream": True, "max_tokens": 16,
            "messages": [{"role": "user", "content": QUESTION}]}
    request = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.startswith(b"data: {") and b'"content"' in line:
                elapsed = time.perf_counter() - start
                response.read()
                return elapsed
    raise RuntimeError("no content chunk")


def serve(work: Path, model: str, name: str, log: Path) -> RunningServer:
    docs = [d for d in map(json.loads, DOCUMENTS.read_text().splitlines()) if d["id"] in BASE]
    docs.append({"id": "probe", "text": EXTRA[name]})
    path = work / f"{name}.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    section = {"key_file": str(work / "noise.key"), "ledger": str(work / f"{name}.sqlite"),
               "aggregate": {"contexts": {"northwind": str(path)}, "mechanism": "answer", "epsilon": 4.0,
                             "total_epsilon": 10000.0, "min_epsilon": 0.5, "on_empty": "refuse"}}
    config = work / f"{name}.json"
    config.write_text(json.dumps({"dp_privacy": section}))
    flags = engine_flags(model, 4, max_model_len=2048)
    return RunningServer([*VLLM_DP, "serve", model, "--dp-config", str(config), *flags], log)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--queries", type=int, default=15)
    p.add_argument("--out", type=Path, default=Path("/tmp/answer_timing.json"))
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="answer-timing-"))
    with serve(work, args.model, "mentions", work / "mentions.log") as a, \
            serve(work, args.model, "silent", work / "silent.log") as b:
        servers = {"mentions": a, "silent": b}
        for server in servers.values():  # warm-up: the documents' prefill is cached from here on
            first_content_seconds(server.base, args.model)
        times: dict[str, list[float]] = {name: [] for name in servers}
        for _ in range(args.queries):
            for name, server in servers.items():
                times[name].append(first_content_seconds(server.base, args.model))
    result = {"question": QUESTION, "queries": args.queries, "load": os.getloadavg(),
              "code": os.popen("git rev-parse --short HEAD").read().strip(),
              "median_s": {k: statistics.median(v) for k, v in times.items()}, "seconds": times}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median_s", "load")}), file=sys.stderr)


if __name__ == "__main__":
    main()
