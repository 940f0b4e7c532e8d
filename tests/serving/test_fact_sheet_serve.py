"""``dp_privacy.fact_sheet`` through `vllm-dp serve` on the real SmolLM2-135M-Instruct (one
server, ~1.5 min): 12 of 13 documents state the headcount and the river in paraphrases, one the
vault code. At start-up the collection's sheet is released once at eps 4 (threshold 9 of 12
votes: a shared fact is missed with probability ~1e-3; the one-document code is released with
probability below delta); the chat answers the headcount from the sheet, never the code; queries
spend nothing and the ledger holds the one release (a restart's same sheet: ``test_fact_sheet``)."""

import json
import sqlite3

import pytest

from tests.aggregate.test_facts import collection
from tests.models.test_serve_real import FLAGS, real_model
from tests.serving.engines import vllm_dp_server
from tests.serving.test_aggregate_serve import call


@pytest.mark.vllm
def test_the_sheet_answers_the_shared_fact_never_the_code_and_queries_spend_nothing(tmp_path):
    model = str(real_model("smollm2-135m-instruct"))
    docs = tmp_path / "ostravo.jsonl"
    docs.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(collection())))
    section = {"key_file": str(tmp_path / "noise.key"), "ledger": str(tmp_path / "ledger.sqlite"),
               "fact_sheet": {"contexts": {"ostravo": str(docs)}, "epsilon": 4.0}}
    config = tmp_path / "dp.json"
    config.write_text(json.dumps({"dp_privacy": section}))
    log = tmp_path / "serve.log"
    with vllm_dp_server([model, "--dp-config", str(config), "--max-model-len", "2048", *FLAGS], log,
                        timeout=900) as base:
        def ask(question: str) -> str:
            status, reply, _ = call(base + "/v1/chat/completions", {
                "model": model, "max_tokens": 24, "temperature": 0.0,
                "messages": [{"role": "user", "content": question}]})
            assert status == 200, reply
            return reply["choices"][0]["message"]["content"]

        assert "3141" in ask("How many people work at Ostravo Foods?")
        for question in ("What is the vault code at Ostravo Foods?", "Which code opens the Ostravo Foods vault?"):
            assert "quendrix" not in ask(question).lower()
        status, budget, _ = call(base + "/v1/dp/budget")
        assert status == 200
        (entry,) = budget["contexts"]
        assert [f["fact"] for f in entry["facts"]] and "Ostravo Foods — 3141" in entry["context"]
        assert entry["ledger"]["releases_of_this_context"] == 1 and entry["per_query"]["epsilon"] == 0.0
    assert "quendrix" not in log.read_text()
    with sqlite3.connect(tmp_path / "ledger.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM releases").fetchone() == (1,)
