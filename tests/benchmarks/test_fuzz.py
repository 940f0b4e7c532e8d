"""``vllm-dp bench fuzz`` (``benchmarks.fuzz``), CI-sized: schemathesis in-process against the DP
HTTP layer (the guard, ``/v1/dp/budget`` and DP aggregation's service, the real code) in front of
vLLM's request schemas, with the fake engine; the checks find nothing there, and do find an
injected 5xx, an injected leak and an overspent budget. The leak rules are tested on their own."""

import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("schemathesis")

import schemathesis
from fastapi import FastAPI
from transformers import AutoTokenizer

from tests.models.test_serve_real import real_model
from tests.serving.fake_engine import FakeEngine
from vllm_dp_plugin.benchmarks.fuzz.checks import (
    Private,
    budget_problems,
    check_response,
    has_receipt,
    log_problems,
)
from vllm_dp_plugin.benchmarks.fuzz.runner import (
    CHAT,
    DP_PROMPTS,
    KEPT_FIELDS,
    Fuzzer,
    bound_body,
    dp_core,
    kind_counts,
    run_order,
    split_cases,
)
from vllm_dp_plugin.config import AggregatePrivacyConfig
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
from vllm_dp_plugin.serving.aggregate import AggregateService, RequestError
from vllm_dp_plugin.serving.http import DynamicBudget, PrivateContextGuard, allowed_post, router

MAX_MODEL_LEN = 256
SECRET = "The alarm code of the Harlow Freight back door is 4471-93."
DOCS = [SECRET, "Memo: the Harlow Freight depot closes at 6 pm on Fridays, every week of the year.",
        "Email: Laura Callahan approves every refund above $500 for the whole West Coast region."]
CASES = 30  # over every operation; an injected fault: INJECTED cases of /v1/completions
INJECTED = 16


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(real_model("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def private(tokenizer) -> Private:
    count = [len(tokenizer.encode(t, add_special_tokens=False)) for t in DOCS]
    return Private.of(DOCS, ["d0", "d1", "d2"], [len(DOCS), *count, *map(len, DOCS), sum(count)], [MAX_MODEL_LEN])


def app(tmp_path, tokenizer, engine: FakeEngine) -> FastAPI:
    """vLLM's OpenAI routes (its request schemas) behind the DP layer as ``init_state`` wires it
    for DP aggregation: the guard answers chat and completions through the service."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(DOCS)))
    cfg = AggregatePrivacyConfig(contexts={"c": str(docs)}, members=2, epsilon=4.0, total_epsilon=20.0,
                                 max_tokens=4, gate="none", budget_file=str(tmp_path / "queries.jsonl"))
    service = AggregateService(cfg, engine, tokenizer, NoiseKey(tmp_path / "noise.key"), "m",
                               (tokenizer.eos_token_id,), MAX_MODEL_LEN)
    api = FastAPI()

    @api.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest):  # answered by the guard (DP aggregation)
        raise AssertionError("unreachable")

    @api.post("/v1/completions")
    async def completions(request: CompletionRequest):
        raise AssertionError("unreachable")

    @api.post("/tokenize")
    async def tokenize(request: CompletionRequest):  # refused by the guard (403)
        raise AssertionError("unreachable")

    @api.get("/health")
    async def health():
        return {}

    api.include_router(router)
    api.add_middleware(PrivateContextGuard)
    api.state.dp_aggregate, api.state.dp_budget = service, DynamicBudget(service.statement)
    api.state.dp_guard, api.state.dp_routes = True, allowed_post(frozenset({"aggregate"}))
    api.state.dp_counters_closed = True
    return api


OPTIONS = {"dp_context": ("c",), "dp_epsilon": (0.5, 2.0, 4.0)}  # what the app serves


def fuzz(api: FastAPI, private: Private, count=None, cases: int = INJECTED, path: str | None = "/v1/completions",
         tally: bool = False):
    schema = schemathesis.openapi.from_asgi("/openapi.json", api)
    if path is not None:
        schema = schema.include(path=path)
    statement = api.state.dp_budget
    fuzzer = Fuzzer(schema, private, {}, statement.compute, count, options=OPTIONS)
    result = fuzzer.run(cases)
    return result if tally else result.summary()


def test_the_dp_layer_passes_every_check(tmp_path, tokenizer, private):
    tally = fuzz(app(tmp_path, tokenizer, FakeEngine(len(tokenizer), MAX_MODEL_LEN)), private,
                 lambda t: len(tokenizer.encode(t, add_special_tokens=False)), CASES, None, tally=True)
    summary = tally.summary()
    assert summary["failures"] == 0, summary
    assert summary["cases"] >= CASES - 5 and summary["budget_reads"] == summary["cases"]
    assert {"200", "400", "403"} <= set(summary["statuses"]), summary  # answered, refused, closed
    # the chat route gets half the cases, every kind of them, and its dp cases reach the DP path
    assert summary["chat_cases"] >= CASES // 2, summary
    chat = tally.operations[CHAT].to_json()
    assert set(chat["kinds"]) == {"positive", "negative", "shaped", "dp"}, chat["kinds"]
    assert chat["kinds"]["dp"].get("200", 0) > 0 and chat["receipts"] > 0, chat


def test_the_chat_route_gets_its_share_and_runs_after_the_others():
    others = [f"GET /route{i}" for i in range(20)]
    names = [*others, CHAT, "POST /v1/completions", "GET /v1/dp/budget"]
    plan = split_cases(names, 2000)
    assert plan[CHAT] == 1000 and abs(sum(plan.values()) - 2000) <= len(names)
    assert plan["POST /v1/completions"] == plan["GET /v1/dp/budget"] > plan["GET /route0"] >= 2
    assert split_cases(names, 2000, 0.0)[CHAT] == 2 and split_cases(others, 100) == dict.fromkeys(others, 5)
    with pytest.raises(ValueError):
        split_cases(names, 10, 1.0)
    order = sorted(names, key=run_order)
    assert order[-3:] == ["GET /v1/dp/budget", CHAT, "POST /v1/completions"] and set(order[:-3]) == set(others)


def test_kinds_of_case_split_by_weight():
    assert kind_counts(["positive", "negative", "shaped", "dp"], 1000) == {
        "positive": 200, "negative": 200, "shaped": 200, "dp": 400}
    assert kind_counts(["positive", "negative"], 5) == {"positive": 3, "negative": 2}
    assert sum(kind_counts(["positive", "negative", "shaped", "dp"], 7).values()) == 7


def test_dp_cases_carry_a_client_core_and_the_mode_options():
    from hypothesis import given, settings

    seen = []
    options = {"dp_context": ("c",), "dp_epsilon": (1.0,), "dp_session": ()}

    @settings(max_examples=60, database=None, deadline=None)
    @given(dp_core("m", options, DP_PROMPTS["/v1/chat/completions"]))
    def check(body):
        seen.append(body)
        assert body["messages"][-1]["role"] == "user" and 1 <= body["max_tokens"] <= 16
        assert set(body.get("vllm_xargs", {})) <= {"dp_context", "dp_epsilon", "dp_session", "dp_typo"}

    check()
    xargs = [b["vllm_xargs"] for b in seen if "vllm_xargs" in b]
    assert any(x.get("dp_context") == "c" for x in xargs) and any(x.get("dp_epsilon") == 1.0 for x in xargs)
    assert any(isinstance(x.get("dp_session"), str) and len(x["dp_session"]) >= 22 for x in xargs)
    assert KEPT_FIELDS == 2
    assert has_receipt({"x-dp-receipt": "{}"}, "") and has_receipt({}, '{"dp_receipt": {}}')
    assert not has_receipt({"content-type": "application/json"}, '{"choices": []}')


def test_an_engine_failure_is_caught_as_a_5xx(tmp_path, tokenizer, private):
    summary = fuzz(app(tmp_path, tokenizer, FakeEngine(len(tokenizer), MAX_MODEL_LEN, fail=True)), private)
    assert summary["failure_kinds"].get("server error 500", 0) > 0, summary


def test_a_leaking_error_and_an_overspent_budget_are_caught(tmp_path, tokenizer, private, monkeypatch):
    def leaky(self, body):
        raise RequestError(400, f"`max_tokens` is too large for {len(DOCS)} documents: {SECRET}")

    monkeypatch.setattr(AggregateService, "_max_tokens", leaky)
    api = app(tmp_path, tokenizer, FakeEngine(len(tokenizer), MAX_MODEL_LEN))
    honest = api.state.dp_budget.compute
    api.state.dp_budget = DynamicBudget(lambda: {**honest(), "ledger": {"spent": 3.0, "total": 2.0,
                                                                       "remaining": -1.0}})
    summary = fuzz(api, private)
    assert summary["failure_kinds"].get("private text", 0) > 0, summary
    assert set(summary["budget_failures"]) == {"spent 3.0 > total 2.0", "remaining -1.0 < 0"}, summary


def test_leak_rules(private):
    assert private.text_leaks("it said: the harlow freight depot closes at 6 pm") == [
        "freight depot closes at 6 pm", "harlow freight depot closes at 6", "the harlow freight depot closes at"]
    assert private.text_leaks("code 4471-93, ask Laura Callahan") == ["4471-93", "Laura Callahan"]
    assert private.text_leaks("code 4471-930 or x4471-93") == []  # whole strings only
    n = len(DOCS[1])
    assert private.number_leaks(f"a document of {n} characters") == [n]
    assert private.number_leaks(f"{n}.5 or v{n} or {n}a") == []  # standalone integers only
    assert private.number_leaks(f"{n} characters", public=[n]) == []  # the request's own
    # a DP answer may quote the documents (the release), an error may not
    answer = {"choices": [{"index": 0, "message": {"content": DOCS[1]}}], "dp_receipt": {"fact": DOCS[1]}}
    assert not check_response(private, 200, {}, json.dumps(answer)).failures
    assert check_response(private, 200, {}, json.dumps(answer)).released_text
    error = {"error": {"message": f"bad `n`: {DOCS[1]}"}}
    assert check_response(private, 400, {}, json.dumps(error)).failures
    assert check_response(private, 400, {}, "not json").failures == ["400 without a JSON error message"]
    assert check_response(private, 400, {}, json.dumps({"error": {"message": "no"}})).names_field is False
    assert check_response(private, 400, {}, json.dumps({"error": {"message": "bad `n`"}})).names_field is True
    ledger = {"spent": {"epsilon": 1.0}, "total": {"epsilon": 2.0}, "remaining": {"epsilon": 1.0}, "queries": n}
    assert budget_problems(private, {"ledger": ledger}) == []  # the clients' own query count
    assert budget_problems(private, {"ledger": ledger, "characters": len(DOCS[0])}) == [
        f"document-derived number {len(DOCS[0])} in the budget statement"]
    logs = log_problems(private, [f"INFO 11-28 {n} vllm-dp: nothing", f"INFO vllm-dp: {n} tokens", "x 4471-93"],
                        ["a client's private prompt, long enough"])
    assert len(logs) == 2 and "4471-93" in logs[1]
    assert log_problems(private, ["echo: a client's private prompt, long enough"],
                        ["a client's private prompt, long enough"])


def test_bound_body_caps_the_work_and_keeps_bad_types():
    body = {"max_tokens": 10**6, "n": 50, "min_tokens": 99}
    bound_body(body)
    assert body == {"max_tokens": 16, "n": 2, "min_tokens": 16}
    body = {"messages": []}
    bound_body(body)
    assert body["max_tokens"] == 16
    body = {"max_tokens": "lots", "n": True}
    bound_body(body)
    assert body == {"max_tokens": "lots", "n": True}
