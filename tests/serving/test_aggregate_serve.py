"""DP aggregation at the output through `vllm-dp serve` on the real SmolLM2-135M-Instruct (one
server, ~1-2 min): chat and completions (streaming too) answer with a receipt, the budget is
spent in the persistent ledger and a query that does not fit gets 429, `/v1/dp/budget` states the
same as `vllm-dp account`, leaking fields are refused, and no document text reaches the log. The
answers are sampled from fresh randomness, so every number is checked exactly against what the
receipts say the sampled path was (private tokens, stop), never against one path."""

import json
import urllib.error
import urllib.request

import pytest
from transformers import AutoTokenizer

from tests.models.test_serve_real import FLAGS, real_model
from tests.serving.engines import vllm_dp_server
from vllm_dp_plugin.config import DPPrivacyConfig
from vllm_dp_plugin.plan import aggregation_params
from vllm_dp_plugin.reports import account_statement

SECRET = "The vault combination at Harlow Freight is 4471-93."
DOCS = [
    "Memo: Harlow Freight's depot closes at 6 pm on Fridays.",
    "Email: On Fridays the Harlow Freight depot closes at 6 pm.",
    "Notice: Harlow Freight's depot shuts at 6 pm every Friday.",
    "FAQ: The Harlow Freight depot closes at 6 pm on Fridays.",
    SECRET,
    "Wiki: Harlow Freight has a depot by the canal.",
]


def call(url: str, body: dict | None = None) -> tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as reply:
            return reply.status, json.loads(reply.read()), dict(reply.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


def stream(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as reply:
        lines = [line.decode().strip() for line in reply]
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def check_receipt(receipt: dict, finish: str, section: dict) -> float:
    """Without a gate (and the free public gate off) every step is private up to the cap of 4,
    the stop token's step included; the receipt charges exactly the settlement of those steps at
    the default epsilon (4: pure, 1 per private token). Returns the charge."""
    params = aggregation_params(DPPrivacyConfig.from_dict(section).aggregate)
    assert receipt["private_tokens"] == min(4, receipt["tokens"] + (finish == "stop"))
    charge = params.settlement(receipt["private_tokens"])
    assert (receipt["epsilon"], receipt["delta"]) == (charge.epsilon, charge.delta)
    return receipt["epsilon"]


@pytest.mark.vllm
def test_aggregate_serves_smollm2(tmp_path):
    model = real_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(model)
    docs = tmp_path / "harlow.jsonl"
    docs.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(DOCS)))
    section = {"key_file": str(tmp_path / "noise.key"),
               "aggregate": {"contexts": {"harlow": str(docs)}, "members": 4, "epsilon": 4.0,
                             "max_epsilon": 8.0, "total_epsilon": 9.5, "max_tokens": 24,
                             "gate": "none", "max_private_tokens": 4}}
    config = tmp_path / "dp.json"
    config.write_text(json.dumps({"dp_privacy": section}))
    log = tmp_path / "serve.log"
    question = [{"role": "user", "content": "When does the Harlow Freight depot close on Fridays?"}]
    with vllm_dp_server([str(model), "--dp-config", str(config), "--max-model-len", "2048", *FLAGS], log,
                        timeout=900) as base:
        status, chat, headers = call(base + "/v1/chat/completions", {"model": str(model), "messages": question})
        assert status == 200, chat
        receipt = chat["dp_receipt"]
        assert json.loads(headers["x-dp-receipt"]) == receipt
        assert receipt["context"] == "harlow" and receipt["tokens"] <= 24
        first = check_receipt(receipt, chat["choices"][0]["finish_reason"], section)
        assert "one document" in receipt["unit"]
        assert chat["usage"]["completion_tokens"] == receipt["tokens"]
        # the conversation only, exactly: no member's documents
        public = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
        assert chat["usage"]["prompt_tokens"] == len(tokenizer.encode(public, add_special_tokens=False))
        assert isinstance(chat["choices"][0]["message"]["content"], str)

        for body, field in [({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
                            ({"n": 2}, "`n`"), ({"vllm_xargs": {"dp_epsilon": 9.0}}, "dp_epsilon"),
                            ({"vllm_xargs": {"dp_context": "other"}}, "dp_context"),
                            ({"vllm_xargs": {"dp_typo": 1}}, "dp_typo"), ({"prompt_logprobs": 1}, "prompt_logprobs")]:
            status, error, _ = call(base + "/v1/chat/completions", {"model": str(model), "messages": question, **body})
            assert status == 400 and field in error["error"]["message"], (body, error)
        assert call(base + "/tokenize", {"model": str(model), "prompt": "x"})[0] == 403

        events = stream(base + "/v1/completions", {"model": str(model), "prompt": "The depot closes at",
                                                   "stream": True, "max_tokens": 8})
        assert all(e["object"] == "text_completion" for e in events)
        last = events[-1]
        assert last["choices"][0]["finish_reason"] in ("stop", "length")
        second = last["dp_receipt"]
        assert second["tokens"] <= 8

        spent = first + check_receipt(second, last["choices"][0]["finish_reason"], section)
        status, budget, _ = call(base + "/v1/dp/budget")
        (entry,) = budget["contexts"]
        assert entry["ledger"]["queries"] == 2
        assert entry["ledger"]["spent"]["epsilon"] == pytest.approx(spent, rel=1e-12)
        # each query charged 1 to 4 (one private token at least, the stop's), so 1.5 to 7.5 of
        # 9.5 is left on every path: a query at 8 reserves its worst case, 8, first and gets 429
        assert 2.0 <= spent <= 8.0
        status, error, _ = call(base + "/v1/chat/completions", {"model": str(model), "messages": question,
                                                                 "vllm_xargs": {"dp_epsilon": 8.0}})
        assert status == 429 and error["error"]["remaining"]["epsilon"] == pytest.approx(9.5 - spent, rel=1e-12)
    text = log.read_text()
    assert "Harlow" not in text and "4471" not in text
    assert "DP aggregation over 1 collection(s)" in text
    statement = account_statement(DPPrivacyConfig.from_dict(section), None)
    assert statement["contexts"][0] == {**entry, "ledger": statement["contexts"][0]["ledger"]}
    assert statement["contexts"][0]["ledger"]["spent"]["epsilon"] == pytest.approx(spent)
