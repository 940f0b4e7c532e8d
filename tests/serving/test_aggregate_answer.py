"""``aggregate.mechanism: answer`` through the service, engine-free (``FakeEngine`` writes each
member's answer from the document its prompt holds): one member per document, one batch of
member answers, one partition selection, the released fact in the public prompt, and the
ledger, receipts and ``on_empty`` around it."""

import asyncio
import functools
import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("wordfreq")

from tests.serving.fake_engine import FakeEngine
from tests.serving.test_aggregate_leaks import MAX_MODEL_LEN, queries, service, tokenizer  # noqa: F401
from vllm_dp_plugin.aggregate.reply import FROM_DOCUMENTS, GENERAL_KNOWLEDGE, NOT_FROM_DOCUMENTS
from vllm_dp_plugin.serving.aggregate import cut

INVENTORY = "When is the Harlow depot closed for inventory?"
ALARM = "What is the alarm code of the Harlow depot?"
# 12 documents: 10 state the inventory date (in different words), one the alarm code, one neither
DOCS = ([(f"d{i}", f"Memo {i}: the Harlow depot closes for inventory on 14 Quintember.") for i in range(6)]
        + [(f"p{i}", f"Note {i}: inventory at the Harlow depot: closed 14 Quintember, all day.") for i in range(4)]
        + [("secret", "Security: the alarm code of the Harlow depot is 739182."),
           ("other", "Lunch at the Harlow depot is served at noon.")])


def member_writer(tok):
    """A member copies the date or the code when its document holds it, else says NONE; the
    public answer says it does not know."""

    def write(ids: list[int]) -> str:
        text = tok.decode(ids)
        if "Document:" not in text:  # the public answer
            return "I don't know"
        document = text.split("Document:")[1].split("\n")[0]
        if "inventory" in text.split("Document:")[1].split("user")[-1] and "Quintember" in document:
            return "14 Quintember"
        if "alarm" in text.split("Document:")[1].split("user")[-1] and "739182" in document:
            return "739182"
        return "NONE"

    return write


def ask(svc, question: str, **body) -> tuple[int, dict]:
    body = {"messages": [{"role": "user", "content": question}], **body}
    reply = asyncio.run(svc.handle("/v1/chat/completions", body))
    return reply.status_code, json.loads(reply.body)


def answer_engine(tok, cls=FakeEngine, **kw) -> FakeEngine:
    """A fake engine whose members answer as ``member_writer`` says, in the tokenizer's ids."""
    return cls(len(tok), MAX_MODEL_LEN, write=member_writer(tok), eos=tok.eos_token_id,
               encode=lambda text: tok.encode(text, add_special_tokens=False), **kw)


def answer_service(tmp_path, tok, **settings):
    engine = answer_engine(tok)
    svc = service(tmp_path, tok, DOCS, engine, mechanism="answer", max_tokens=16, answer_tokens=8, **settings)
    return svc, engine


def test_one_member_per_document_one_batch_and_the_shared_fact_released(tmp_path, tokenizer):  # noqa: F811
    svc, engine = answer_service(tmp_path, tokenizer)
    assert len(svc.collections["c"].member_prefixes) == len(DOCS)  # not aggregate.members=4
    status, body = ask(svc, INVENTORY)
    assert status == 200
    members = engine.calls
    assert len(members) == len(DOCS) and {c["cache_salt"] for c in members} == {svc.source.member_salt}
    receipt = body["dp_receipt"]  # the reply states the released fact and stops: no public continuation
    assert body["choices"][0]["message"]["content"] == FROM_DOCUMENTS.format(fact="14 quintember")
    assert body["choices"][0]["finish_reason"] == "stop"
    assert receipt["mechanism"] == "answer" and receipt["released"] and receipt["fact"] == "14 quintember"
    assert receipt["noisy_count"] >= 5  # the threshold at eps 4, delta 1e-6
    assert receipt["epsilon"] == svc.cfg.epsilon and 0 < receipt["delta"] <= svc.cfg.delta
    assert receipt["requested_epsilon"] == receipt["epsilon"] and queries(svc) == 1


def test_every_member_decodes_exactly_answer_tokens_and_is_cut_afterwards(tmp_path, tokenizer):  # noqa: F811
    """The timing channel: members stopped at "\n" or EOS, and the reply waited for all of them,
    so "if your document mentions X, repeat it" made a matching document add decode steps. Now
    every member request decodes exactly ``answer_tokens`` tokens (EOS ignored, no stop
    strings) and its answer is cut at the first EOS and line break afterwards: the same votes."""
    from vllm_dp_plugin.serving.aggregate import member_text

    svc, engine = answer_service(tmp_path, tokenizer)
    status, body = ask(svc, INVENTORY)
    assert status == 200 and body["dp_receipt"]["fact"] == "14 quintember"
    members = engine.calls
    for call in members:
        params = call["params"]
        assert params.max_tokens == svc.cfg.answer_tokens and params.ignore_eos and not params.stop
        assert not params.stop_token_ids and params.min_tokens == 0  # EOS is generated, not masked
    assert all(call["params"].allowed_token_ids is None for call in members)  # answer_vocabulary: any
    eos, enc = tokenizer.eos_token_id, functools.partial(tokenizer.encode, add_special_tokens=False)
    stops = (eos,)
    assert member_text(tokenizer, [*enc("14 Quintember"), eos, *enc("more words")], stops) == "14 Quintember"
    assert member_text(tokenizer, enc("14 Quintember\nAnd then"), stops) == "14 Quintember"
    assert member_text(tokenizer, [*enc("\n"), *enc("14 Quintember")], stops) == ""  # as a stop at "\n" did


def test_answer_vocabulary_document_restricts_each_member_to_its_own_documents_tokens(tmp_path, tokenizer):  # noqa: F811
    svc, engine = answer_service(tmp_path, tokenizer, answer_vocabulary="document")
    assert ask(svc, INVENTORY)[0] == 200
    vocabularies = svc.collections["c"].member_vocabularies
    for call, vocab, (_, text) in zip(engine.calls, vocabularies, DOCS, strict=True):
        assert call["params"].allowed_token_ids == sorted(vocab)
        assert set(tokenizer.encode(text, add_special_tokens=False)) | {tokenizer.eos_token_id} <= vocab
        assert set(tokenizer.encode("NONE", add_special_tokens=False)) <= vocab
    secret = set(tokenizer.encode(" 739182", add_special_tokens=False))
    assert not secret <= vocabularies[0] and secret <= vocabularies[DOCS.index(DOCS[-2])]  # its own document's


def test_a_secret_one_document_states_is_not_released_and_the_fallback_says_so(tmp_path, tokenizer):  # noqa: F811
    """Count 1 against threshold 5 (eps 4, delta 1e-6): released with probability delta; 20
    queries (each a fresh release: ``reuse_answers`` off). The reply first says the documents gave
    no answer it can share, then marks the public model's answer (the conversation alone) as
    general knowledge, streamed alike."""
    svc, engine = answer_service(tmp_path, tokenizer, reuse_answers=False)
    for _ in range(20):
        status, body = ask(svc, ALARM)
        assert status == 200 and not body["dp_receipt"]["released"] and body["dp_receipt"]["fact"] is None
        assert "739182" not in tokenizer.decode(engine.calls[-1]["ids"]) and "Document" not in tokenizer.decode(
            engine.calls[-1]["ids"])  # the public answer sees the conversation alone
        assert body["choices"][0]["message"]["content"] == f"{NOT_FROM_DOCUMENTS} {GENERAL_KNOWLEDGE} I don't know"
    assert queries(svc) == 20

    async def streamed():
        body = {"messages": [{"role": "user", "content": ALARM}], "stream": True}
        reply = await svc.handle("/v1/chat/completions", body)
        return [chunk async for chunk in reply.body_iterator]

    events = [json.loads(e.removeprefix("data: ")) for e in asyncio.run(streamed()) if e.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == f"{NOT_FROM_DOCUMENTS} {GENERAL_KNOWLEDGE} I don't know"


def test_on_empty_refuse_says_the_documents_do_not_answer_and_still_charges(tmp_path, tokenizer):  # noqa: F811
    svc, engine = answer_service(tmp_path, tokenizer, on_empty="refuse")
    status, body = ask(svc, ALARM)
    assert status == 200 and body["choices"][0]["message"]["content"] == NOT_FROM_DOCUMENTS
    assert len(engine.calls) == len(DOCS)  # no public answer
    assert body["dp_receipt"]["epsilon"] == svc.cfg.epsilon and queries(svc) == 1


def test_a_long_released_fact_is_cut_to_answer_tokens(tokenizer):  # noqa: F811
    long = " ".join(["quintember"] * 40)
    assert cut(tokenizer, long, 8).count("quintember") <= 8
    assert cut(tokenizer, "14 quintember", 8) == "14 quintember"


def test_a_completion_prompt_rendered_from_a_chat_asks_its_last_user_message(tmp_path, tokenizer):  # noqa: F811
    svc, _ = answer_service(tmp_path, tokenizer)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": INVENTORY}], tokenize=False,
                                             add_generation_prompt=True)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert svc._question("/v1/completions", {}, ids) == INVENTORY
    plain = tokenizer.encode("Harlow depot inventory:", add_special_tokens=False)
    assert svc._question("/v1/completions", {}, plain) == "Harlow depot inventory:"


def test_answer_members_groups_documents_by_keyed_hash_into_a_public_number(tmp_path, tokenizer):  # noqa: F811
    key = tmp_path / "noise.key"  # a fixed key: its grouping fits the member bound (a random one may not)
    key.write_bytes(bytes(range(32)))
    key.chmod(0o600)
    svc, engine = answer_service(tmp_path, tokenizer, answer_members=4)
    members = svc.collections["c"].member_documents
    assert len(members) == 4 and sorted(d for m in members for d in m) == sorted(t for _, t in DOCS)
    ask(svc, INVENTORY)
    assert len(engine.calls) == 4 + 1  # four members, one public answer
    assert svc.statement()["contexts"][0]["members"] == "4 by keyed hash"


class CountingEngine(FakeEngine):
    """FakeEngine that records how many sub-requests are in the engine at once."""

    now = most = hold = 0  # sub-requests in the engine now, at most; how many a sub-request waits for (1 s at most)

    async def generate(self, prompt, params, request_id):
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            for _ in range(1000):  # a sub-request stays in the engine until `hold` are in (a step's batch)
                if self.now >= self.hold:
                    break
                await asyncio.sleep(0.001)
            async for out in super().generate(prompt, params, request_id):
                yield out
        finally:
            self.now -= 1


def test_the_members_of_one_query_and_of_concurrent_queries_are_in_the_engine_together(tmp_path, tokenizer):  # noqa: F811
    """The engine gets every member of a query at once (one batch: `asyncio.gather`, no lock or
    semaphore), and the members of queries in flight side by side; the public answer after its
    query's members (the release needs them all)."""
    engine = answer_engine(tokenizer, CountingEngine)
    engine.hold = len(DOCS)
    svc = service(tmp_path, tokenizer, DOCS, engine, mechanism="answer", max_tokens=16, answer_tokens=8,
                  reuse_answers=False)
    ask(svc, INVENTORY)
    assert engine.most == len(DOCS) and engine.now == 0

    async def four():
        body = {"messages": [{"role": "user", "content": INVENTORY}]}
        return await asyncio.gather(*(svc.handle("/v1/chat/completions", body) for _ in range(4)))

    engine.most, engine.hold = 0, 4 * len(DOCS)
    replies = asyncio.run(four())
    assert [r.status_code for r in replies] == [200] * 4 and engine.most == 4 * len(DOCS)
    assert queries(svc) == 5


def strip_query_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


@pytest.mark.parametrize(("member", "budgets"), [("model", {}), ("extract", {}),
                                                ("extract", {"per_document_epsilon": 40.0}),
                                                ("model", {"answer_batch": 10, "per_document_epsilon": 40.0})])
@pytest.mark.parametrize("removed", ["secret", "other", "d3"])
def test_neighbouring_collections_give_the_same_bytes_but_for_the_dp_outputs(tmp_path, tokenizer, caplog, removed,  # noqa: F811
                                                                             member, budgets):
    """Collections one document apart (the secret's, a document stating nothing, one stating the
    shared fact): a too-long prompt, an engine failure and the secret's question answer with the
    same status, body (but for the query's id and time) and log lines; nothing is released about
    the secret in either (probability delta per query). For both member kinds (``answer_member``:
    with ``extract`` the engine serves only the public fallback), and with per-document budgets
    (whose receipt states no remaining budget: what documents spent is private)."""
    import logging

    def neighbour(docs, **kw):
        engine = answer_engine(tokenizer, **kw)
        return service(tmp_path, tokenizer, docs, engine, mechanism="answer", max_tokens=16, answer_tokens=8,
                       answer_member=member, **budgets)

    pair = (DOCS, [d for d in DOCS if d[0] != removed])
    long_question = "inventory " * (MAX_MODEL_LEN // 2)
    (tmp_path / "warm").mkdir()  # one-time import logs (vLLM's Triton notice) fall outside the comparison
    ask(service(tmp_path / "warm", tokenizer, DOCS, answer_engine(tokenizer), mechanism="answer", max_tokens=16,
                answer_tokens=8, answer_member=member), ALARM)
    for engine_kw, question in (({}, ALARM), ({}, long_question), ({"fail": True}, ALARM)):
        seen = []
        for docs in pair:
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="vllm_dp_plugin"):
                status, body = ask(neighbour(docs, **engine_kw), question)
            seen.append((status, strip_query_ids(body), [r.getMessage() for r in caplog.records]))
        assert seen[0] == seen[1], (engine_kw, question[:40])
        assert seen[0][0] in (200, 400, 500)


def test_the_released_count_carries_discrete_laplace_noise_of_scale_one_over_eps(tmp_path, tokenizer):  # noqa: F811
    """30 documents state the fact; at eps 1 the receipt's noisy count is 30 + Z with
    Var Z = 2q / (1 - q)^2, q = e^-1 (1.84). 100 queries: the sample variance lies within
    [0.40, 3.0] x that (simulated offline: outside with probability ~1e-4); no noise (0) falls
    outside, and half the noise (Var 0.36 = 0.19 x) in 995 of 1000 runs."""
    import math

    import numpy as np

    docs = [(f"d{i}", f"Memo {i}: the Harlow depot closes for inventory on 14 Quintember.") for i in range(30)]
    engine = answer_engine(tokenizer)
    svc = service(tmp_path, tokenizer, docs, engine, mechanism="answer", max_tokens=4, answer_tokens=8,
                  epsilon=1.0, total_epsilon=1000.0, reuse_answers=False)
    counts = [ask(svc, INVENTORY)[1]["dp_receipt"]["noisy_count"] for _ in range(100)]
    q = math.exp(-1.0)
    var = 2 * q / (1 - q) ** 2
    assert abs(np.mean(counts) - 30) < 4 * math.sqrt(var / 100)
    assert 0.40 * var <= np.var(counts, ddof=1) <= 3.0 * var


def test_answer_member_extract_reads_the_documents_and_runs_no_member(tmp_path, tokenizer):  # noqa: F811
    """``answer_member: extract``: the ten documents that state the date vote for it read by rule
    (no member reaches the engine), the secret's one document stays under the threshold, and the
    statement says how members vote and drops the batch-invariance assumption."""
    svc, engine = answer_service(tmp_path, tokenizer, answer_member="extract")
    status, body = ask(svc, INVENTORY)
    assert status == 200 and engine.calls == []  # nothing decoded: the reply is the release
    assert body["choices"][0]["message"]["content"] == FROM_DOCUMENTS.format(fact="14 quintember")
    assert body["dp_receipt"]["released"] and body["dp_receipt"]["noisy_count"] >= 5
    status, body = ask(svc, ALARM)
    assert status == 200 and not body["dp_receipt"]["released"]
    assert len(engine.calls) == 1 and "Document" not in tokenizer.decode(engine.calls[0]["ids"])  # the public answer
    statement = svc.statement(())["contexts"][0]
    assert "extract" in statement["member_votes"] and "batch" not in statement["assumes"]
    assert queries(svc) == 2


def test_answer_batch_runs_exactly_k_members_only_where_a_document_can_answer(tmp_path, tokenizer):  # noqa: F811
    """``answer_batch: 6``: every query sends exactly six member requests to the engine (the
    ``ignore_eos`` ones), whatever the documents: for a question no document can answer, six
    members that see no document (and, with per-document budgets, no document is charged); for
    one most documents can answer, six of them, in a keyed order of the question and the ids.
    Replies and receipts have the same shape; the release is calibrated for l0 = 2 (threshold 5
    at eps 8)."""
    import numpy as np

    svc, engine = answer_service(tmp_path, tokenizer, answer_batch=6, epsilon=8.0, max_epsilon=8.0,
                                 per_document_epsilon=80.0, reuse_answers=False)
    assert svc.statement(())["contexts"][0]["selection"]["keys_per_document"] == 2

    def members(question):
        engine.calls.clear()
        status, body = ask(svc, question)
        assert status == 200
        sent = [c for c in engine.calls if c["params"].ignore_eos]
        return sent, body

    sent, body = members("What is the capital of France?")
    assert len(sent) == 6 and not any("Document:" in tokenizer.decode(c["ids"]) for c in sent)
    assert not body["dp_receipt"]["released"]
    labels = svc.document_labels["c"]
    assert not svc.documents.spent("c", labels)[:, 0].any()  # no document could answer: none charged
    sent, body = members(INVENTORY)
    with_documents = [c for c in sent if "Document:" in tokenizer.decode(c["ids"])]
    assert len(sent) == 6 and len(with_documents) == 6
    assert np.count_nonzero(svc.documents.spent("c", labels)[:, 0]) == 6  # the six that ran, voted or not
    again, _ = members(INVENTORY)
    assert [c["ids"] for c in again] == [c["ids"] for c in sent]  # the same six: a keyed order, not chance


def test_answer_batch_is_refused_where_it_cannot_apply():
    from vllm_dp_plugin.config import AggregatePrivacyConfig, ConfigError

    for settings in ({"mechanism": "vote"}, {"answer_member": "extract"}, {"answer_members": 8}):
        with pytest.raises(ConfigError, match="aggregate.answer_batch needs mechanism: answer"):
            AggregatePrivacyConfig(contexts={"c": "d.jsonl"}, **{"mechanism": "answer", "answer_batch": 4, **settings})


def test_an_answer_batch_below_the_release_threshold_is_refused(tmp_path, tokenizer):  # noqa: F811
    """Eight members can never reach the threshold of 9 (eps 4, l0 = 2): the server refuses to
    start (naming the key), and a request for an epsilon whose threshold exceeds the batch gets a 400."""
    from vllm_dp_plugin.config import ConfigError

    with pytest.raises(ConfigError, match=r"aggregate.answer_batch=8 members can never reach the release threshold 9"):
        answer_service(tmp_path, tokenizer, answer_batch=8)
    (tmp_path / "ok").mkdir()
    svc, _ = answer_service(tmp_path / "ok", tokenizer, answer_batch=12)
    status, body = ask(svc, INVENTORY, vllm_xargs={"dp_epsilon": 1.0})
    assert status == 400 and "dp_epsilon" in body["error"]["message"] and "answer_batch=12" in body["error"]["message"]
