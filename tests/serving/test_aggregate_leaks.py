"""DP aggregation's side channels closed (error texts, metrics, logs), engine-free: a fake engine that,
like vLLM, names a too-long prompt's length. Two collections that differ by one document must
give a client the same bytes everywhere but in the DP outputs: errors (length, engine failure),
log lines, the prefix cache (salts) and the counters (/metrics, stats log)."""

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.serving.fake_engine import FakeEngine
from vllm_dp_plugin.config import AggregatePrivacyConfig, ConfigError, parse_section
from vllm_dp_plugin.privacy.accountant import Budget
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
from vllm_dp_plugin.privacy.ledger_store import open_store
from vllm_dp_plugin.serving.aggregate import QUERY_FAILED, AggregateService
from vllm_dp_plugin.serving.http import COUNTERS_CLOSED, PrivateContextGuard, check_log_stats
from vllm_dp_plugin.serving.launch import serve_arguments

MAX_MODEL_LEN = 512
DOCS = [f"Memo {i}: the depot of Harlow Freight number {i} closes at {i % 12 + 1} pm." for i in range(12)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from vllm_dp_plugin.demo import make_demo_llama

    return AutoTokenizer.from_pretrained(make_demo_llama(tmp_path_factory.mktemp("demo") / "llama"))


def service(tmp_path, tokenizer, docs, engine=None, **settings) -> AggregateService:
    """A service over one collection ``docs`` (ids d0, d1, ...; a removed document keeps the others' ids)."""
    path = tmp_path / f"docs-{len(docs)}.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs))
    settings = {"members": 4, "epsilon": 4.0, "total_epsilon": 400.0, "max_tokens": 8, "gate": "none", **settings}
    cfg = AggregatePrivacyConfig(contexts={"c": str(path)}, **settings)
    engine = engine or FakeEngine(len(tokenizer), MAX_MODEL_LEN)
    return AggregateService(cfg, engine, tokenizer, NoiseKey(tmp_path / "noise.key"), "m", (tokenizer.eos_token_id,),
                            MAX_MODEL_LEN, open_store(tmp_path / f"ledger-{len(docs)}.sqlite"))


def neighbours(tmp_path, tokenizer, **kw) -> tuple[AggregateService, AggregateService]:
    docs = [(f"d{i}", t) for i, t in enumerate(DOCS)]
    return (service(tmp_path, tokenizer, docs, **kw),
            service(tmp_path, tokenizer, [d for d in docs if d[0] != "d5"], **kw))


def answer(svc: AggregateService, path: str, body: dict) -> tuple[int, dict]:
    reply = asyncio.run(svc.handle(path, body))
    return reply.status_code, json.loads(reply.body)


def queries(svc: AggregateService) -> int:
    return svc.ledger.status("c", Budget(400.0, 1e-4)).queries


def test_a_member_over_the_public_bound_is_refused_at_start_up_without_its_length(tmp_path, tokenizer):
    long_doc = [("big", "word " * 300)]
    with pytest.raises(ConfigError) as err:
        service(tmp_path, tokenizer, long_doc, max_member_tokens=100)
    assert str(err.value) == ("aggregate.contexts.c: a member's documents exceed aggregate.max_member_tokens=100 "
                              "tokens; raise the bound (or max_model_len) or add members")  # no true length
    with pytest.raises(ConfigError, match="leave no room"):
        service(tmp_path, tokenizer, long_doc, max_member_tokens=MAX_MODEL_LEN - 8)


def test_a_prompt_too_long_for_a_member_is_refused_before_the_engine_alike_for_neighbours(tmp_path, tokenizer):
    """The leak: a completions prompt that fits alone but not after a member's documents made
    vLLM name the member's prefix length. Now the public bound decides, before any reservation."""
    a, b = neighbours(tmp_path, tokenizer)
    assert a.member_bound == b.member_bound == MAX_MODEL_LEN // 2  # the default: half of max_model_len
    room = MAX_MODEL_LEN - a.member_bound - 8
    replies = []
    for svc in (a, b):
        fits = answer(svc, "/v1/completions", {"prompt": list(range(5, 5 + room)), "max_tokens": 8})
        assert fits[0] == 200, fits
        replies.append(answer(svc, "/v1/completions", {"prompt": list(range(5, 6 + room)), "max_tokens": 8}))
        assert queries(svc) == 1  # the refused one reserved nothing
    assert replies[0] == replies[1] and replies[0][0] == 400
    message = replies[0][1]["error"]["message"]
    assert f"max_model_len={MAX_MODEL_LEN}" in message and f"max_member_tokens={a.member_bound}" in message
    assert f"{room + 1} tokens after a member's documents" in message


def test_an_engine_error_inside_a_query_is_one_fixed_error_and_log_line(tmp_path, tokenizer, caplog):
    a, b = neighbours(tmp_path, tokenizer)
    for svc in (a, b):
        svc.source.engine.fail = True
    caplog.set_level(logging.INFO, logger="vllm.dp_privacy")
    body = {"messages": [{"role": "user", "content": "When does the depot close?"}]}
    replies = [answer(svc, "/v1/chat/completions", body) for svc in (a, b)]
    assert replies[0] == replies[1] == (500, {"error": {"message": QUERY_FAILED, "type": "InternalServerError",
                                                        "code": 500}})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"vllm-dp: {QUERY_FAILED}"] * 2  # nothing else, no engine text, no traceback
    assert all("length" not in line for line in lines)
    assert queries(a) == queries(b) == 1  # the reservation is spent (settled at the worst case)


def test_a_failing_stream_ends_with_the_same_fixed_error(tmp_path, tokenizer):
    svc = service(tmp_path, tokenizer, [("d0", DOCS[0])], engine=FakeEngine(len(tokenizer), MAX_MODEL_LEN, fail=True))
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}

    async def collect():
        reply = await svc.handle("/v1/chat/completions", body)
        return [chunk async for chunk in reply.body_iterator]

    events = [e.removeprefix("data: ").strip() for e in asyncio.run(collect())]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["message"] == QUERY_FAILED


def test_members_carry_a_secret_cache_salt_and_the_public_sequence_a_fresh_one(tmp_path, tokenizer):
    """No client-chosen sequence can share a cached block with a member: members are salted with a
    keyed per-deployment salt, the public sequence (what the client sends) with its own per query
    (a member no document hashed to is the public sequence: see the next test)."""
    svc = service(tmp_path, tokenizer, [(f"d{i}", t) for i, t in enumerate(DOCS)])
    body = {"messages": [{"role": "user", "content": "When does the depot close?"}], "max_tokens": 2}
    for _ in range(2):
        assert answer(svc, "/v1/chat/completions", body)[0] == 200
    calls = svc.source.engine.calls
    prefixes = svc.collections["c"].member_prefixes  # sub-request i > 0 is member i - 1
    index = [int(c["request_id"].rsplit("-", 1)[1]) for c in calls]
    publics = [c for c, i in zip(calls, index) if i == 0]
    members = [c for c, i in zip(calls, index) if i > 0 and prefixes[i - 1]]
    assert members
    member_salts = {c["cache_salt"] for c in members}
    assert len(member_salts) == 1 and None not in member_salts  # one keyed salt, every query
    assert member_salts == {NoiseKey(tmp_path / "noise.key").mac("aggregate/cache-salt", "members").hex()}
    public_salts = [c["cache_salt"] for c in publics]
    assert len(set(public_salts)) == 2 and not set(public_salts) & member_salts  # fresh per query


@pytest.mark.parametrize("mechanism", ["vote", "answer"])
def test_no_client_chosen_sequence_runs_under_the_members_salt_empty_members_included(tmp_path, tokenizer, mechanism):
    """An empty member (a member no document hashed to) sees the client's conversation alone.
    Under the members' secret salt, a conversation that starts with a guessed ``Document:
    <text>`` system turn would share cached blocks with the member holding that text, and its
    time to first byte would tell the guess. Every sub-request under the members' salt starts
    with a member's documents; empty members get a fresh salt per query."""
    key = tmp_path / "noise.key"  # a fixed key: 2 documents in 8 members leave empty ones
    key.write_bytes(bytes(range(32)))
    key.chmod(0o600)
    grouping = {"answer_members": 8} if mechanism == "answer" else {"members": 8}
    svc = service(tmp_path, tokenizer, [(f"d{i}", t) for i, t in enumerate(DOCS[:2])], mechanism=mechanism,
                  max_tokens=2, **grouping)
    prefixes = svc.collections["c"].member_prefixes
    assert 0 < sum(not p for p in prefixes) < len(prefixes)
    guess = [{"role": "system", "content": "Document: " + DOCS[0]}, {"role": "user", "content": "Hi"}]
    for _ in range(2):
        assert answer(svc, "/v1/chat/completions", {"messages": guess, "max_tokens": 2})[0] == 200
    calls = svc.source.engine.calls
    secret = [c for c in calls if c["cache_salt"] == svc.source.member_salt]
    assert secret and all(any(p and c["ids"][:len(p)] == list(p) for p in prefixes) for c in secret)
    empty = {c["cache_salt"] for c in calls if c["cache_salt"] != svc.source.member_salt}
    assert len(empty) >= 2  # fresh per query


def test_aggregation_off_the_cpu_needs_a_batch_invariant_engine_or_the_risk_stated(monkeypatch):
    """A query's members decode in one batch: where the engine is not batch-invariant one document
    could change other members' answers. The CPU engine is (test_batch_invariance.py); a GPU
    engine must run with VLLM_BATCH_INVARIANT=1, or the operator states the risk."""
    from vllm import envs
    from vllm.platforms import current_platform

    from vllm_dp_plugin.plan import aggregate_report
    from vllm_dp_plugin.serving.aggregate import check_batch_invariance

    cfg = AggregatePrivacyConfig(contexts={"c": "docs.jsonl"}, mechanism="answer")
    check_batch_invariance(cfg)  # this CPU engine
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", False, raising=False)
    with pytest.raises(ConfigError, match="VLLM_BATCH_INVARIANT=1"):
        check_batch_invariance(cfg)
    allowed = AggregatePrivacyConfig(contexts={"c": "docs.jsonl"}, mechanism="answer", allow_batch_variance=True)
    check_batch_invariance(allowed)
    assert "batch composition" in aggregate_report(allowed, "c", None)["not_protected"]
    assert "batch composition" not in aggregate_report(cfg, "c", None)["not_protected"]
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", True, raising=False)
    check_batch_invariance(cfg)
    with pytest.raises(ConfigError, match="allow_batch_variance"):
        AggregatePrivacyConfig(contexts={"c": "docs.jsonl"}, allow_batch_variance="yes")


def test_metrics_are_closed_and_the_stats_log_is_off_while_private_prompts_run(tmp_path):
    app = FastAPI()
    app.add_middleware(PrivateContextGuard)

    @app.get("/metrics")
    async def metrics():
        return {"vllm:prompt_tokens_total": 6046}

    client = TestClient(app)
    assert client.get("/metrics").status_code == 200  # DP off
    app.state.dp_counters_closed = True
    for path in ("/metrics", "/metrics/"):
        reply = client.get(path)
        assert reply.status_code == 403 and reply.json()["error"]["message"] == COUNTERS_CLOSED
    check_log_stats(SimpleNamespace(disable_log_stats=True), True)
    check_log_stats(SimpleNamespace(disable_log_stats=False), False)
    with pytest.raises(ConfigError, match="--disable-log-stats"):
        check_log_stats(SimpleNamespace(disable_log_stats=False), True)
    key = str(tmp_path / "k")
    for section, forced in (({"aggregate": {"contexts": {"c": "x.jsonl"}}}, True),
                            ({"prompt": {"mechanism": "paraphrase"}}, True),
                            ({"prompt": {"mechanism": "laplace"}}, True),  # a request may ask for paraphrase
                            ({"prompt": {"mechanism": "laplace", "allow_request_override": False}}, False)):
        path = tmp_path / "dp.json"
        path.write_text(json.dumps({"dp_privacy": {"key_file": key, **section}}))
        assert ("--disable-log-stats" in serve_arguments(["MODEL"], str(path))) == forced
        assert serve_arguments(["MODEL", "--disable-log-stats"], str(path)).count("--disable-log-stats") == 1


def test_paraphrase_refuses_too_many_or_too_long_messages_before_any_rewrite():
    from vllm_dp_plugin.serving.renderer import DPRenderer

    cfg = parse_section({"prompt": {"mechanism": "paraphrase", "paraphrase_max_messages": 2,
                                    "paraphrase_max_input_tokens": 5}}).prompt
    renderer = SimpleNamespace(_prompt=SimpleNamespace(cfg=cfg), _encode=lambda text: text.split())
    DPRenderer._check_paraphrase_input(renderer, ["one two", "three four five six seven"])
    with pytest.raises(ValueError, match="paraphrase_max_messages=2 user messages a request, this chat has 3"):
        DPRenderer._check_paraphrase_input(renderer, ["a", "b", "c"])
    with pytest.raises(ValueError, match="paraphrase_max_input_tokens=5 tokens, this chat has one of 6"):
        DPRenderer._check_paraphrase_input(renderer, ["a b c d e f"])


def test_each_paraphrase_rewrite_runs_under_a_fresh_cache_salt(tmp_path, tokenizer):
    """The raw message goes through the shared engine: a later request (a guess of the text) must
    not hit its cached blocks."""
    from vllm_dp_plugin.prompt.paraphrase import ParaphraseMechanism
    from vllm_dp_plugin.serving.renderer import DPRenderer

    class Engine:
        def __init__(self):
            self.vllm_config, self.prompts = SimpleNamespace(speculative_config=None), []

        async def generate(self, prompt, params, request_id):
            self.prompts.append(prompt)
            yield SimpleNamespace(outputs=[SimpleNamespace(text=" a rewrite ")])

    cfg = parse_section({"prompt": {"mechanism": "paraphrase"}}).prompt
    engine = Engine()
    renderer = SimpleNamespace(_engine=engine, _rewrite_refusal=None, _prompt=SimpleNamespace(cfg=cfg),
                               _key=NoiseKey(tmp_path / "noise.key"), tokenizer=tokenizer)
    mechanism = ParaphraseMechanism(epsilon=10.0)
    for _ in range(2):
        assert asyncio.run(DPRenderer._rewrite(renderer, "my secret text", mechanism)) == "a rewrite"
    salts = [p.get("cache_salt") for p in engine.prompts]
    assert len(salts) == 2 and None not in salts and salts[0] != salts[1] and len(salts[0]) == 32


# ------------------------------- the budget's wiring (client quotas, running totals, async ledger) 
def test_clients_answer_with_their_key_only_and_spend_their_own_share(tmp_path, tokenizer):
    import hashlib

    from vllm_dp_plugin.privacy.query_ledger import Quota

    clients = {"alice": {"api_key_sha256": hashlib.sha256(b"key-a").hexdigest(), "share": 0.25},
               "bob": {"api_key_sha256": hashlib.sha256(b"key-b").hexdigest(), "share": 0.5}}
    svc = service(tmp_path, tokenizer, [("d0", DOCS[0]), ("d1", DOCS[1])], clients=clients)
    body = {"messages": [{"role": "user", "content": "When?"}], "max_tokens": 2}

    def ask(auth: bytes | None):
        headers = [] if auth is None else [(b"authorization", auth)]
        reply = asyncio.run(svc.handle("/v1/chat/completions", body, headers))
        return reply.status_code, json.loads(reply.body)

    for auth in (None, b"Bearer nope", b"Basic key-a", b"key-a"):
        status, error = ask(auth)
        assert status == 401 and "aggregate.clients" in error["error"]["message"]
    assert queries(svc) == 0  # nothing reserved for an unknown caller
    status, answer_a = ask(b"Bearer key-a")
    assert status == 200
    alice = svc.ledger.status("c", Budget(400.0, 1e-4), Quota("alice", 0.25))
    assert alice.queries == 1 and alice.total.epsilon == 100.0
    assert answer_a["dp_receipt"]["remaining"]["epsilon"] == pytest.approx(100.0 - alice.spent.epsilon)
    assert svc.ledger.status("c", Budget(400.0, 1e-4), Quota("bob", 0.5)).queries == 0


def test_a_spent_budget_answers_429_with_numbers_but_no_server_path(tmp_path, tokenizer):
    svc = service(tmp_path, tokenizer, [("d0", DOCS[0])], total_epsilon=4.0)
    body = {"messages": [{"role": "user", "content": "When?"}], "max_tokens": 2}
    assert answer(svc, "/v1/chat/completions", body)[0] == 200
    status, error = answer(svc, "/v1/chat/completions", body)
    assert status == 429 and str(tmp_path) not in json.dumps(error) and "ledger" not in error["error"]["message"]
    assert error["error"]["message"].startswith("query budget on context 'c' exhausted: requested ")


def test_a_lost_key_refuses_to_start_over_the_old_ledger(tmp_path, tokenizer):
    docs = [("d0", DOCS[0])]
    svc = service(tmp_path, tokenizer, docs)
    assert answer(svc, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})[0] == 200
    (tmp_path / "noise.key").unlink()  # lost: the next start makes a new key
    with pytest.raises(ConfigError, match="allow_foreign_ledger"):
        service(tmp_path, tokenizer, docs)
    assert service(tmp_path, tokenizer, docs, allow_foreign_ledger=True).ledger.check_key() == 1  # its one reservation


def test_a_ledger_that_cannot_be_written_refuses_with_503_before_any_member_runs(tmp_path, tokenizer):
    """Disk full or a read-only file: the reservation fails, so nothing may be computed; the
    client gets a 503 naming no path, and the log says why."""
    import sqlite3

    svc = service(tmp_path, tokenizer, [("d0", DOCS[0]), ("d1", DOCS[1])])
    store = svc.ledger.store
    path = store.path
    store._conn.close()
    store._conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, check_same_thread=False)
    body = {"messages": [{"role": "user", "content": "When?"}], "max_tokens": 2}
    status, error = answer(svc, "/v1/chat/completions", body)
    assert status == 503 and "ledger" in error["error"]["message"] and str(tmp_path) not in json.dumps(error)
    assert svc.source.engine.calls == [] and queries(svc) == 0


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": [5, 10**6]}, "`prompt`"),  # past the vocabulary: the engine would fail (500)
    ("/v1/completions", {"prompt": [5, -1]}, "`prompt`"),
    ("/v1/completions", {"prompt": ""}, "`prompt`"),  # the engine refuses an empty prompt (500)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
     "`messages`"),  # the demo template concatenates content as a string
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "`messages`"),
    ("/v1/completions", {"prompt": "Hi", "max_completion_tokens": -1}, "`max_completion_tokens`"),
    ("/v1/completions", {"prompt": "Hi", "max_completion_tokens": None, "max_tokens": True}, "`max_tokens`"),
])
def test_a_request_the_service_cannot_read_is_a_400_naming_the_field_before_any_reservation(
        tmp_path, tokenizer, path, body, field):
    """Found by fuzzing (``vllm-dp bench fuzz``): an empty completion prompt reached the engine
    and failed the query (500, its budget spent), as out-of-vocabulary prompt ids would; a message the chat template cannot render
    raised a bare exception (vLLM's handler made it a 400 naming no field)."""
    svc = service(tmp_path, tokenizer, [("d0", DOCS[0])])
    status, error = answer(svc, path, body)
    assert status == 400 and error["error"]["message"].startswith(field), error
    assert queries(svc) == 0 and not svc.source.engine.calls


def test_the_budget_route_answers_503_when_the_ledger_cannot_be_read():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_dp_plugin.privacy.ledger_store import LedgerUnavailable
    from vllm_dp_plugin.serving.http import DynamicBudget, router

    def down():
        raise LedgerUnavailable("ledger /srv/secret-path/ledger.sqlite: disk I/O error")

    app = FastAPI()
    app.include_router(router)
    app.state.dp_budget = DynamicBudget(down)
    reply = TestClient(app).get("/v1/dp/budget")
    assert reply.status_code == 503 and "ledger" in reply.json()["error"]["message"]
    assert "secret-path" not in reply.text


METRICS_PATHS = ("/metrics", "/metrics/", "/metrics/x", "/metricsx", "/metrics.txt")


def metrics_app(*extra_routes) -> FastAPI:
    """vLLM's own metrics routes (``instrumentator.metrics.attach_router``: the instrumentator's
    GET /metrics and the Prometheus Mount with path_regex ``^/metrics(?P<path>.*)$``), an
    unrelated GET route, the guard in front."""
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router

    app = FastAPI()
    attach_router(app)
    app.routes.extend(extra_routes)
    app.add_middleware(PrivateContextGuard)

    @app.get("/health")
    async def health():
        return {}

    return app


def test_every_path_vllms_metrics_mount_serves_is_closed_for_every_method():
    """The leak: only the exact path /metrics was closed, but vLLM's Mount answers any path that
    starts with /metrics (/metrics/x, /metricsx, /metrics.txt) with the whole registry."""
    app = metrics_app()
    client = TestClient(app)
    for path in METRICS_PATHS:  # with DP off each of them serves the registry
        reply = client.get(path)
        assert reply.status_code == 200 and "# HELP" in reply.text, path
    app.state.dp_counters_closed = True
    for path in METRICS_PATHS:
        for method in ("GET", "HEAD", "OPTIONS", "PUT", "DELETE"):
            reply = client.request(method, path)
            assert reply.status_code == 403, (method, path, reply.status_code)
            if method != "HEAD":
                assert reply.json()["error"]["message"] == COUNTERS_CLOSED
    assert client.get("/health").status_code == 200
    behind = TestClient(app, root_path="/api")  # a server under --root-path: routed without it
    for path in ("/api/metrics", "/api/metrics/x", "/api/metricsx"):
        assert behind.get(path).status_code == 403, path
    assert behind.get("/api/health").status_code == 200


def test_the_closed_paths_follow_the_apps_own_metrics_patterns():
    """A pattern that serves /metrics and more (here: any letter case) is read from the app's
    routes, not typed in: /METRICS/x is closed because the route answering /metrics answers it."""
    import regex
    from prometheus_client import make_asgi_app
    from starlette.routing import Mount

    wide = Mount("/metrics", make_asgi_app())
    wide.path_regex = regex.compile("(?i)^/metrics(?P<path>.*)$")
    app = metrics_app(wide)
    app.state.dp_counters_closed = True
    client = TestClient(app)
    assert client.get("/METRICS/x").status_code == 403
    assert client.get("/health").status_code == 200
