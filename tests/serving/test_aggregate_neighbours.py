"""DP aggregation's side channels end to end: two `vllm-dp serve` of SmolLM2-135M-Instruct with DP aggregation over
collections that differ by one document. What an attacker reads (a too-long prompt's error, an
ordinary answer's shape and usage, `/metrics`, the server's log) is the same for both, but for the
DP outputs (the answer's text and its receipt's spent epsilon). Two server starts (~2-4 min)."""

import json
import re

import pytest

from tests.models.test_serve_real import FLAGS, real_model
from tests.serving.engines import vllm_dp_server
from tests.serving.test_aggregate_serve import call

MAX_MODEL_LEN = 1024
DOCS = [f"Memo {i}: the Harlow Freight depot number {i} closes at {i % 12 + 1} pm and opens at 7 am." for i in range(12)]
REMOVED = "d5"


def observe(tmp_path, model, docs: list[tuple[str, str]], tag: str) -> dict:
    """What a client and the log show of one server; the files of each live in ``tmp_path/tag``
    under the same names (paths in the log differ only there: replaced by ``<dir>``)."""
    where = tmp_path / tag
    where.mkdir()
    path = where / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs))
    section = {"key_file": str(tmp_path / "noise.key"),  # one key: the same partition of the shared documents
               "ledger": str(where / "ledger.sqlite"),
               "aggregate": {"contexts": {"harlow": str(path)}, "members": 4, "epsilon": 4.0, "total_epsilon": 40.0,
                             "max_tokens": 4}}
    config = where / "dp.json"
    config.write_text(json.dumps({"dp_privacy": section}))
    log = where / "serve.log"
    seen = {}
    with vllm_dp_server([str(model), "--dp-config", str(config), "--max-model-len", str(MAX_MODEL_LEN), *FLAGS], log,
                        timeout=900) as base:
        seen["metrics"] = call(base + "/metrics")[:2]
        # fits alone, not after the longest member allowed: refused from public numbers only
        seen["too_long"] = call(base + "/v1/completions", {"model": str(model), "prompt": list(range(5, 5 + 700)),
                                                           "max_tokens": 4})[:2]
        status, answer, headers = call(base + "/v1/chat/completions", {
            "model": str(model), "messages": [{"role": "user", "content": "When does depot 3 close?"}]})
        receipt = answer.pop("dp_receipt")
        seen["answer"] = (status, sorted(answer), answer["usage"]["prompt_tokens"], sorted(receipt),
                          receipt["tokens"] <= 4, sorted(headers))
    text = log.read_text().replace(str(where), "<dir>")
    seen["log"] = [re.sub(r"\d+(\.\d+)?", "N", line.split("] ", 1)[-1]) for line in text.splitlines()
                   if "vllm-dp" in line or "dp_privacy" in line]
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
    assert a["metrics"][0] == 403 and a["too_long"][0] == 400
    assert "max_member_tokens=512" in a["too_long"][1]["error"]["message"]
    assert not a["stats_log"] and not a["documents_in_log"]
    assert a["answer"][0] == 200 and a["log"]
