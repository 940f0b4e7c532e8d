"""``GET /v1/dp/budget`` under DP aggregation with client quotas, engine-free (fake engine, the
real route, guard and service): a caller sees the public statement, its own client ledger, or
(the operator's key) every client's, never another client's; ``vllm-dp account`` prints the
operator's view from the same code; the statement depends on the configuration and the ledger
only (neighbouring collections give the same bytes); and budget calls cannot keep the ledger's
store busy: one read serves every concurrent call until this server writes the ledger or a
second passes."""

import asyncio
import hashlib
import json

import httpx
import pytest

pytest.importorskip("vllm")

from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.serving.fake_engine import FakeEngine
from vllm_dp_plugin.config import AggregatePrivacyConfig, ConfigError
from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
from vllm_dp_plugin.privacy.ledger_store import open_store
from vllm_dp_plugin.reports import aggregate_statement
from vllm_dp_plugin.serving.aggregate import AggregateService
from vllm_dp_plugin.serving.http import (
    DynamicBudget,
    PrivateContextGuard,
    _payload,
    allowed_post,
    router,
)

MAX_MODEL_LEN = 512
DOCS = [f"Memo {i}: the depot of Harlow Freight number {i} closes at {i % 12 + 1} pm." for i in range(12)]
KEYS = {"alice": b"key-a", "bob": b"key-b", "operator": b"key-operator"}
CLIENTS = {name: {"api_key_sha256": hashlib.sha256(KEYS[name]).hexdigest(), "share": 0.25} for name in ("alice", "bob")}
QUESTION = {"messages": [{"role": "user", "content": "When does the depot close?"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from vllm_dp_plugin.demo import make_demo_llama

    return AutoTokenizer.from_pretrained(make_demo_llama(tmp_path_factory.mktemp("demo") / "llama"))


def service(tmp_path, tokenizer, docs=DOCS, name="a") -> AggregateService:
    path = tmp_path / f"docs-{name}.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(docs) if t))
    cfg = AggregatePrivacyConfig(contexts={"c": str(path)}, members=4, epsilon=4.0, total_epsilon=400.0, max_tokens=2,
                                 gate="none", clients=CLIENTS,
                                 operator_key_sha256=hashlib.sha256(KEYS["operator"]).hexdigest())
    return AggregateService(cfg, FakeEngine(len(tokenizer), MAX_MODEL_LEN), tokenizer, NoiseKey(tmp_path / "noise.key"),
                            "m", (tokenizer.eos_token_id,), MAX_MODEL_LEN, open_store(tmp_path / f"ledger-{name}.sqlite"))


def app_for(svc: AggregateService) -> FastAPI:
    """The plugin's HTTP layer as ``init_state`` wires it for DP aggregation."""
    app = FastAPI()
    app.include_router(router)
    app.add_middleware(PrivateContextGuard)
    app.state.dp_aggregate, app.state.dp_budget = svc, DynamicBudget(svc.statement, svc.viewer)
    app.state.dp_guard, app.state.dp_routes = True, allowed_post(frozenset({"aggregate"}))
    return app


def auth(who: str | None) -> dict:
    return {} if who is None else {"Authorization": "Bearer " + KEYS[who].decode()}


def client_ledgers(statement: dict) -> dict[str, int]:
    """client -> its queries, for the client ledgers the statement shows."""
    (report,) = statement["contexts"]
    return {name: c["ledger"]["queries"] for name, c in report["clients"].items() if "ledger" in c}


@pytest.fixture
def served(tmp_path, tokenizer):
    svc = service(tmp_path, tokenizer)
    client = TestClient(app_for(svc))
    for who in ("alice", "alice", "bob"):
        assert client.post("/v1/chat/completions", json=QUESTION, headers=auth(who)).status_code == 200
    return svc, client


def test_each_caller_sees_its_own_client_ledger_the_operator_every_one(served):
    """The leak: every client's spending went to anyone, unauthenticated."""
    _, client = served
    budget = {who: client.get("/v1/dp/budget", headers=auth(who)) for who in (None, "alice", "bob", "operator")}
    assert all(reply.status_code == 200 for reply in budget.values())
    assert client_ledgers(budget[None].json()) == {}  # the public statement: no client's ledger
    assert client_ledgers(budget["alice"].json()) == {"alice": 2}
    assert client_ledgers(budget["bob"].json()) == {"bob": 1}
    assert client_ledgers(budget["operator"].json()) == {"alice": 2, "bob": 1}
    for reply in budget.values():  # public in every view: the configuration and the collection's total
        (report,) = reply.json()["contexts"]
        assert report["ledger"]["queries"] == 3 and set(report["clients"]) == {"alice", "bob"}
        assert all(c["share"] == 0.25 for c in report["clients"].values())
    assert "Harlow" not in json.dumps([r.json() for r in budget.values()])
    # a key that names no one: 401, as on the query routes; other schemes are no bearer key
    wrong = client.get("/v1/dp/budget", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "AuthenticationError"
    assert client_ledgers(client.get("/v1/dp/budget", headers={"Authorization": "Basic a2V5LWE="}).json()) == {}
    # the operator's key answers no query: it is no client's
    assert client.post("/v1/chat/completions", json=QUESTION, headers=auth("operator")).status_code == 401


def test_vllm_dp_account_prints_the_operators_view_and_the_log_the_public_one(served):
    svc, client = served
    operator = client.get("/v1/dp/budget", headers=auth("operator")).json()
    assert aggregate_statement(svc.cfg, svc.ledger) == operator  # what `vllm-dp account` prints
    public = client.get("/v1/dp/budget").json()
    assert aggregate_statement(svc.cfg, svc.ledger, ()) == public
    assert _payload(DynamicBudget(svc.statement, svc.viewer)) == public  # the start-up log line


def test_the_operator_key_is_validated_like_a_clients():
    for digest, message in (("abc", "aggregate.operator_key_sha256 must be the 64 hex digits"),
                            (7, "aggregate.operator_key_sha256 must be the 64 hex digits"),
                            (CLIENTS["bob"]["api_key_sha256"], "is the key of client 'bob' too")):
        with pytest.raises(ConfigError, match=message):
            AggregatePrivacyConfig(contexts={"c": "docs.jsonl"}, clients=CLIENTS, operator_key_sha256=digest)
    cfg = AggregatePrivacyConfig(contexts={"c": "docs.jsonl"}, clients=CLIENTS,
                                 operator_key_sha256=hashlib.sha256(KEYS["operator"]).hexdigest().upper())
    assert cfg.is_operator_key("key-operator") and not cfg.is_operator_key("key-a")
    assert not AggregatePrivacyConfig(contexts={"c": "docs.jsonl"}).is_operator_key("key-operator")


def test_every_view_is_the_same_for_neighbouring_collections(tmp_path, tokenizer):
    """Nothing the route adds reads the documents: two collections one document apart, with the
    same ledger history, give the same bytes in every view."""
    docs = [t if i != 5 else "" for i, t in enumerate(DOCS)]  # d5 removed, the others keep their ids
    a, b = service(tmp_path, tokenizer, DOCS, "a"), service(tmp_path, tokenizer, docs, "b")
    total = Budget(400.0, 1e-4)
    for svc in (a, b):
        for who, spent in (("alice", 3.0), ("bob", 1.5)):
            reservation = svc.ledger.reserve("c", total, Budget(4.0, 1e-6), svc.cfg.clients[who].quota)
            svc.ledger.settle(reservation, Budget(spent, 1e-6))
    replies = [[TestClient(app_for(svc)).get("/v1/dp/budget", headers=auth(who)).content
                for who in (None, "alice", "bob", "operator")] for svc in (a, b)]
    assert replies[0] == replies[1]


def test_concurrent_budget_calls_share_one_ledger_read_and_queries_go_on(served, monkeypatch):
    """The leak's other half: each call read (1 + clients) statuses, each a transaction under
    the store's lock that every reservation takes, so a flood of unauthenticated calls could
    starve the queries. Now one read (one transaction) serves every call until this server
    writes the ledger (then the statement is exact) or ``max_age`` passes."""
    svc, _ = served
    store = svc.ledger.store
    reads, transaction = [], store.transaction

    def counted(*, write, durable=True):
        reads.append(write)
        return transaction(write=write, durable=durable)

    monkeypatch.setattr(store, "transaction", counted)
    now = [0.0]
    svc.statements.clock = lambda: now[0]
    app = app_for(svc)
    whos = (None, "alice", "bob", "operator")

    async def flood(queries: int):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dp") as client:
            budget = [client.get("/v1/dp/budget", headers=auth(whos[i % 4])) for i in range(200)]
            asked = [client.post("/v1/chat/completions", json=QUESTION, headers=auth("alice")) for _ in range(queries)]
            return await asyncio.gather(*budget, *asked)

    replies = asyncio.run(flood(0))
    assert [r.status_code for r in replies] == [200] * 200
    assert reads == [False]  # one read transaction for 200 calls and four views
    reads.clear()
    replies = asyncio.run(flood(4))
    assert [r.status_code for r in replies] == [200] * 204  # every query answered amid the flood
    writes = sum(reads)
    assert writes == 8 and len(reads) - writes <= writes + 1  # at most one read per write of this server
    operator = TestClient(app).get("/v1/dp/budget", headers=auth("operator")).json()
    assert client_ledgers(operator) == {"alice": 6, "bob": 1}  # exact after this server's writes
    reads.clear()
    for _ in range(3):
        TestClient(app).get("/v1/dp/budget")
    assert reads == []
    now[0] += svc.statements.max_age  # another server may have written a shared store
    TestClient(app).get("/v1/dp/budget")
    assert reads == [False]
