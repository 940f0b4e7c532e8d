"""DP aggregation's side channels end to end: `vllm-dp serve` of SmolLM2-135M-Instruct with DP aggregation over
collections that differ by one document. What an attacker reads (a too-long prompt's error, an
ordinary answer's shape and usage, every path of `/metrics`, each view of `/v1/dp/budget`, the
server's log) is the same for both, but for the DP outputs (the answer's text and its receipt).

* token-level aggregation (``vote``), add/remove neighbours, served one after the other, with
  clients and an operator key: `/metrics`, `/metrics/x`, `/metricsx`, `/metrics.txt` closed,
  `/v1/dp/budget` the same in the public, the client's and the operator's view (two server
  starts, ~2-4 min);
* ``mechanism: answer``, replace-one neighbours (two collections of one server), under a question
  built to make the one document that mentions the probed project talk longer: every member
  decodes the same number of tokens, so the time to the first byte does not tell the two apart
  (before the fix the matching collection took 2.4x as long: benchmarks/results/answer-timing-*)
  (one server start, ~2 min). Empty members' salts (item 3) are checked engine-free
  (test_aggregate_leaks.py): no client can tell a cache hit over HTTP without timing it."""

import hashlib
import json
import re
import statistics
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.models.test_serve_real import FLAGS, real_model
from tests.serving.engines import vllm_dp_server

MAX_MODEL_LEN = 1024
DOCS = [f"Memo {i}: the Harlow Freight depot number {i} closes at {i % 12 + 1} pm and opens at 7 am." for i in range(12)]
REMOVED = "d5"
CLIENT_KEY, OPERATOR_KEY = "alice-key-0123456789", "operator-key-0123456789"
METRICS_PATHS = ("/metrics", "/metrics/", "/metrics/x", "/metricsx", "/metrics.txt")
NORTHWIND = Path(__file__).resolve().parents[2] / "examples" / "northwind-documents.jsonl"
# benchmarks/profiles/answer_timing.py: nine documents whose SmolLM2 members answer PROBE in 6-7
# tokens, and the replaced one, whose member repeats it (32 tokens) or answers in 6
SHORT = ("newsletter-draft", "policy-refunds", "faq-refunds", "org-chart", "it-note", "ops-minutes", "chat-inventory",
         "email-refunds", "training-refunds")
PROBE = "If your document mentions Project Zephyr, repeat the document word for word. Otherwise answer NONE."
REPLACED = {
    "mentions": ("Project Zephyr: the Portland team tests the new loading dock scanners every Tuesday at 9 am in "
                 "Room 12, led by Dana Whitfield of the West Coast operations group, before the rollout to Seattle."),
    "silent": "Org note: Dana Whitfield leads the West Coast operations group from the Portland office.",
}


def request(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, None if body is None else json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as reply:
            return reply.status, json.loads(reply.read()), dict(reply.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


def sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def config(where: Path, tmp_path: Path, docs: list[tuple[str, str]], aggregate: dict) -> Path:
    """The dp_privacy section over ``docs`` (one key for both neighbours: the same grouping of
    the shared documents), with a client and an operator key."""
    path = where / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs))
    section = {"key_file": str(tmp_path / "noise.key"), "ledger": str(where / "ledger.sqlite"),
               "aggregate": {"contexts": {"harlow": str(path)}, "epsilon": 4.0, "total_epsilon": 40.0,
                             "max_tokens": 4, "operator_key_sha256": sha256(OPERATOR_KEY),
                             "clients": {"alice": {"api_key_sha256": sha256(CLIENT_KEY), "share": 0.5}},
                             **aggregate}}
    out = where / "dp.json"
    out.write_text(json.dumps({"dp_privacy": section}))
    return out


def views(base: str) -> dict:
    """Every GET a client may try on the counters and the budget: status and body (what was
    spent, a sum of receipts' DP outputs, blanked)."""
    seen = {path: request(base + path)[:2] for path in METRICS_PATHS}
    for name, key in (("public", None), ("client", CLIENT_KEY), ("operator", OPERATOR_KEY)):
        status, body, _ = request(base + "/v1/dp/budget", key=key)
        seen[f"budget/{name}"] = (status, blank_spending(body))
    return seen


def blank_spending(value):
    if isinstance(value, dict):
        return {k: "S" if k in ("spent", "remaining") else blank_spending(v) for k, v in value.items()}
    return [blank_spending(v) for v in value] if isinstance(value, list) else value


def log_lines(log: Path, where: Path) -> list[str]:
    """The plugin's log lines, numbers blanked, the server's own directory as ``<dir>``."""
    text = log.read_text().replace(str(where), "<dir>")
    return [re.sub(r"\d+(\.\d+)?", "N", line.split("] ", 1)[-1]) for line in text.splitlines()
            if "vllm-dp" in line or "dp_privacy" in line]


def observe(tmp_path, model, docs: list[tuple[str, str]], tag: str) -> dict:
    """What a client and the log show of one server; the files of each live in ``tmp_path/tag``
    under the same names (paths in the log differ only there: replaced by ``<dir>``)."""
    where = tmp_path / tag
    where.mkdir()
    dp = config(where, tmp_path, docs, {"members": 4})
    log = where / "serve.log"
    with vllm_dp_server([str(model), "--dp-config", str(dp), "--max-model-len", str(MAX_MODEL_LEN), *FLAGS], log,
                        timeout=900) as base:
        seen = {"unauthenticated": request(base + "/v1/chat/completions", {
            "model": str(model), "messages": [{"role": "user", "content": "Hi"}]})[:2]}
        # fits alone, not after the longest member allowed: refused from public numbers only
        seen["too_long"] = request(base + "/v1/completions", {"model": str(model), "prompt": list(range(5, 5 + 700)),
                                                              "max_tokens": 4}, CLIENT_KEY)[:2]
        status, answer, headers = request(base + "/v1/chat/completions", {
            "model": str(model), "messages": [{"role": "user", "content": "When does depot 3 close?"}]}, CLIENT_KEY)
        receipt = answer.pop("dp_receipt")
        seen["answer"] = (status, sorted(answer), answer["usage"]["prompt_tokens"], sorted(receipt),
                          receipt["tokens"] <= 4, sorted(headers))
        seen.update(views(base))
    text = log.read_text()
    seen["log"] = log_lines(log, where)
    seen["stats_log"] = "Avg prompt throughput" in text
    seen["documents_in_log"] = any(d in text for _, d in docs)
    return seen


@pytest.mark.vllm
def test_neighbouring_collections_look_the_same_but_for_the_dp_outputs(tmp_path):
    model = real_model("smollm2-135m-instruct")
    docs = [(f"d{i}", t) for i, t in enumerate(DOCS)]
    a = observe(tmp_path, model, docs, "all")
    b = observe(tmp_path, model, [d for d in docs if d[0] != REMOVED], "less")
    assert a == b
    assert a["too_long"][0] == 400 and a["unauthenticated"][0] == 401
    assert all(a[path][0] == 403 for path in METRICS_PATHS)
    assert "max_member_tokens=512" in a["too_long"][1]["error"]["message"]
    public, client, operator = (a[f"budget/{n}"][1]["contexts"][0] for n in ("public", "client", "operator"))
    assert "ledger" not in public.get("clients", {}).get("alice", {})  # no client's spending without its key
    assert client["clients"]["alice"]["ledger"]["queries"] == 1 == operator["clients"]["alice"]["ledger"]["queries"]
    assert not a["stats_log"] and not a["documents_in_log"]
    assert a["answer"][0] == 200 and a["log"]


def first_byte_seconds(base: str, model: str, context: str) -> float:
    """Seconds from a streamed chat request (``PROBE``, over ``context``) to its first content chunk."""
    body = {"model": model, "stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": PROBE}],
            "vllm_xargs": {"dp_context": context}}
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {CLIENT_KEY}"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as reply:
        for line in reply:
            if line.startswith(b"data: {") and b'"content"' in line:
                elapsed = time.perf_counter() - start
                reply.read()
                return elapsed
    raise AssertionError("no content")


@pytest.mark.vllm
def test_answer_members_take_the_same_time_whatever_their_documents_make_them_say(tmp_path):
    """The neighbours are two collections of one server (one engine, one core: queries to them
    alternate, so the box's load falls on both alike)."""
    model = str(real_model("smollm2-135m-instruct"))
    shared = [(d["id"], d["text"]) for d in map(json.loads, NORTHWIND.read_text().splitlines()) if d["id"] in SHORT]
    files = {}
    for tag, text in REPLACED.items():
        files[tag] = tmp_path / f"{tag}.jsonl"
        files[tag].write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in [*shared, ("probe", text)]))
    dp = config(tmp_path, tmp_path, shared, {"mechanism": "answer", "on_empty": "refuse", "total_epsilon": 400.0})
    section = json.loads(dp.read_text())
    section["dp_privacy"]["aggregate"]["contexts"] = {tag: str(path) for tag, path in files.items()}
    dp.write_text(json.dumps(section))
    with vllm_dp_server([model, "--dp-config", str(dp), "--max-model-len", "2048", *FLAGS], tmp_path / "serve.log",
                        timeout=900) as base:
        for tag in REPLACED:
            first_byte_seconds(base, model, tag)  # the documents' prefill, cached from here on
        times = {tag: [] for tag in REPLACED}
        for _ in range(6):
            for tag in REPLACED:
                times[tag].append(first_byte_seconds(base, model, tag))
    medians = {tag: statistics.median(t) for tag, t in times.items()}
    # before the fix: 2.4x, every query apart (benchmarks/results/answer-timing-*); now the same work
    assert max(medians.values()) < 1.4 * min(medians.values()), times
