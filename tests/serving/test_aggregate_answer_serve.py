"""``aggregate.mechanism: answer`` through `vllm-dp serve` on the real SmolLM2-135M-Instruct
over the bundled collection (``examples/serve-smollm2-aggregate.yaml``, what `make serve` runs;
one server, ~2 min; members that read, ``answer_member: extract``): the inventory dates, stated
by 8 of its 22 documents, 6 of them as "September 14" in a clause naming the warehouse and the
inventory, are released at eps 4 per query (count 6 against threshold 5, noise of scale 0.25:
missed with probability q^2 / (1 + q) = 3.3e-4, q = e^-4) and are the reply; the alarm code,
stated by one document, is never released (probability delta per query) and no reply carries it;
budgets are per document (``per_document_epsilon``): the statement gives the caps and no sum over
documents, and the same question again gets the earlier release, charged to nobody."""

import json
from pathlib import Path

import pytest
import yaml

from tests.models.test_serve_real import FLAGS, real_model
from tests.serving.engines import vllm_dp_server
from tests.serving.test_aggregate_serve import call

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve-smollm2-aggregate.yaml"
ALARM = "4471"


def ask(base: str, model: str, question: str) -> dict:
    status, reply, _ = call(base + "/v1/chat/completions", {"model": model, "max_tokens": 24,
                                                            "messages": [{"role": "user", "content": question}]})
    assert status == 200, reply
    return reply


@pytest.mark.vllm
def test_the_bundled_collection_answers_its_shared_fact_and_never_the_alarm_code(tmp_path):
    model = str(real_model("smollm2-135m-instruct"))
    section = yaml.safe_load(EXAMPLE.read_text())["dp_privacy"]
    section["key_file"] = str(tmp_path / "noise.key")
    section["aggregate"]["contexts"] = {"northwind": str(EXAMPLE.parent / "northwind-documents.jsonl")}
    assert section["aggregate"]["mechanism"] == "answer" and section["aggregate"]["epsilon"] == 4.0
    assert section["aggregate"]["answer_member"] == "extract"
    config = tmp_path / "dp.json"
    config.write_text(json.dumps({"dp_privacy": section}))
    log = tmp_path / "serve.log"
    with vllm_dp_server([model, "--dp-config", str(config), "--max-model-len", "2048", *FLAGS], log,
                        timeout=900) as base:
        dates = ask(base, model, "When is the Seattle warehouse closed for inventory?")
        receipt = dates["dp_receipt"]
        assert receipt["released"] and receipt["fact"] == "september 14", receipt
        assert dates["choices"][0]["message"]["content"].startswith("From the documents: september 14.")
        codes = [ask(base, model, q) for q in ("What is the alarm code of the Seattle warehouse back door?",
                                                "Which code opens the back door of the Seattle warehouse?")]
        for reply in codes:
            assert not reply["dp_receipt"]["released"] and ALARM not in reply["choices"][0]["message"]["content"]
        again = ask(base, model, "When is the Seattle warehouse closed for inventory?")["dp_receipt"]
        assert again["reused"] and again["epsilon"] == 0.0 and again["fact"] == "september 14"
        status, budget, _ = call(base + "/v1/dp/budget")
        assert status == 200
        (entry,) = budget["contexts"]
        assert entry["budget"] == {"per_document": {"epsilon": 40.0, "delta": 1e-4}} and "ledger" not in entry
    assert ALARM not in log.read_text() and "Seattle" not in log.read_text()
