"""Serving a DP fact sheet (``serving.fact_sheet``): requests get the released sheet as a plain
context through the HTTP guard, nothing else changes; the statement (``/v1/dp/budget``, ``vllm-dp
account``, ``vllm-dp release-facts``) from one code path; the release recorded once."""

import json

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.aggregate.test_facts import collection
from vllm_dp_plugin.cli import main as cli
from vllm_dp_plugin.config import DPPrivacyConfig
from vllm_dp_plugin.plan import release_fact_sheets
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
from vllm_dp_plugin.privacy.release_ledger import ReleaseLedger, ReleaseRefused
from vllm_dp_plugin.serving.fact_sheet import FactSheetError, FactSheetService
from vllm_dp_plugin.serving.http import PrivateContextGuard, allowed_post


def write_config(tmp_path, **settings) -> tuple:
    docs = tmp_path / "ostravo.jsonl"
    docs.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(collection())))
    (tmp_path / "empty.jsonl").write_text(json.dumps({"id": "x", "text": "Nothing here."}) + "\n")
    section = {"key_file": "noise.key", "ledger": "ledger.sqlite",
               "fact_sheet": {"contexts": {"ostravo": "ostravo.jsonl", "empty": "empty.jsonl"}, **settings}}
    path = tmp_path / "dp.json"
    path.write_text(json.dumps({"dp_privacy": section}))
    return path


def released(tmp_path, **settings):
    from vllm_dp_plugin.config import parse_section, section_from_file

    cfg = parse_section(section_from_file(write_config(tmp_path, **settings)))
    key = NoiseKey(cfg.key_file)
    return cfg, release_fact_sheets(cfg.fact_sheet, key, ReleaseLedger(key, cfg.ledger_store(key)))


def test_a_restart_serves_the_same_sheet_and_another_release_is_refused(tmp_path):
    _, first = released(tmp_path)
    assert first["ostravo"].sheet.lines and first["empty"].sheet.facts == ()
    _, again = released(tmp_path)
    assert again["ostravo"].sheet == first["ostravo"].sheet  # keyed noise: the same release
    assert again["ostravo"].history.to_json()["releases_of_this_context"] == 1
    with pytest.raises(ReleaseRefused, match="fact_sheet.allow_rerelease"):
        released(tmp_path, epsilon=2.0)  # other settings: other noise over the same documents
    _, both = released(tmp_path, epsilon=2.0, allow_rerelease=True)
    assert both["ostravo"].history.total.epsilon == pytest.approx(6.0)  # composed


def service(tmp_path) -> FactSheetService:
    cfg, sheets = released(tmp_path)
    return FactSheetService(cfg.fact_sheet, sheets)


def test_chat_gets_the_facts_about_its_question_as_its_system_turn(tmp_path):
    s = service(tmp_path)
    text = s.sheets["ostravo"].system_text()
    assert "Ostravo Foods — 3141" in text and "Glimmerbeck River" in text and "quendrix42" not in text
    user = [{"role": "user", "content": "How many people work at Ostravo Foods?"}]
    assert s.rewrite("/v1/chat/completions", {"messages": user})["messages"] == [
        {"role": "system", "content": text}, *user]  # both facts name Ostravo Foods
    river = s.rewrite("/v1/chat/completions", {"messages": [{"role": "user", "content": "Is the river deep?"}]})
    assert river["messages"][0]["content"].endswith("\n- Glimmerbeck River — Ostravo Foods")  # that fact alone
    own = [{"role": "system", "content": "Be brief."}, *user]
    assert s.rewrite("/v1/chat/completions", {"messages": own})["messages"][0]["content"] == f"{text}\n\nBe brief."
    prompts = ["Ostravo Foods: staff?", "and its river?"]
    assert s.rewrite("/v1/completions", {"prompt": prompts})["prompt"] == [f"{text}\n\n{p}" for p in prompts]
    public = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    assert s.rewrite("/v1/chat/completions", public) == public  # about nothing on the sheet: as asked
    empty = {"messages": user, "vllm_xargs": {"dp_context": "empty"}}
    assert s.rewrite("/v1/chat/completions", empty) == {"messages": user, "vllm_xargs": {}}  # nothing released


@pytest.mark.parametrize("path,body,match", [
    ("/v1/completions", {"prompt": [1, 2, 3]}, "token ids"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "vllm_xargs": {"dp_context": "nope"}},
     "dp_context='nope' names no collection; served: empty, ostravo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "vllm_xargs": {"dp_epsilon": 1}},
     "vllm_xargs.dp_epsilon"),
])
def test_requests_the_sheet_cannot_serve_get_a_400_naming_the_field(tmp_path, path, body, match):
    with pytest.raises(FactSheetError, match=match):
        service(tmp_path).rewrite(path, body)


def test_the_guard_forwards_the_rewritten_body(tmp_path):
    s = service(tmp_path)
    app = FastAPI()
    app.add_middleware(PrivateContextGuard)
    app.state.dp_guard, app.state.dp_routes, app.state.dp_fact_sheet = False, allowed_post(frozenset({"fact_sheet"})), s

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        return {"echoed_body": body}

    client = TestClient(app)
    body = {"messages": [{"role": "user", "content": "Ostravo Foods?"}], "logprobs": True}  # public: nothing refused
    got = client.post("/v1/chat/completions", json=body).json()["echoed_body"]
    assert got["messages"][0] == {"role": "system", "content": s.sheets["ostravo"].system_text()}
    assert got["logprobs"] is True
    bad = client.post("/v1/chat/completions", json={"messages": "x"})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
    assert client.post("/v1/responses", json={"input": "hi"}).status_code == 403  # would skip the sheet


def test_budget_account_and_release_facts_state_one_release(tmp_path, capsys):
    s = service(tmp_path)
    report = s.statement["contexts"][0]
    assert s.statement["mode"] == "fact_sheet" and report["per_query"] == {"epsilon": 0.0, "delta": 0.0}
    assert report["release"]["epsilon"] == pytest.approx(4.0) and report["release"]["threshold"] == 9
    assert report["context"] == s.sheets["ostravo"].system_text() and len(report["facts"]) == 2
    path = tmp_path / "dp.json"
    assert cli(["release-facts", "--config", str(path)]) == 0  # recorded already: the same sheet
    out = capsys.readouterr().out
    assert "released facts (2): " in out and "Ostravo Foods — 3141" in out and "releases of this collection: 1" in out
    assert cli(["account", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "DP fact sheet of collection 'ostravo'" in out and "per query: nothing" in out


def test_fact_sheet_excludes_the_other_private_context_sections():
    base = {"fact_sheet": {"contexts": {"a": "a.jsonl"}}}
    for other in ({"aggregate": {"contexts": {"a": "a.jsonl"}}}, {"attention": {"epsilon": 1.0, "delta": 1e-6}}):
        with pytest.raises(Exception, match="not .*fact_sheet"):
            DPPrivacyConfig.from_dict({**base, **other})


def test_neighbouring_collections_look_the_same_but_for_the_dp_outputs(tmp_path, caplog):
    """Collections that differ by one document (the secret's, a stating one) give the same
    sheet keys at eps 4 (counts 12 vs 11 against threshold 9); what a client reads through the
    guard (bodies for a shared, a secret and a public question, error texts, the statement less
    its noisy counts and ledger time) is identical. The engine sees only the sheet's text, so its
    timing, /metrics and prefix cache see the same prompts too."""
    import logging

    def view(docs: list[str], where) -> dict:
        where.mkdir()
        write_config(where)  # the configuration; the collection replaced by ``docs``
        (where / "ostravo.jsonl").write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n"
                                                     for i, t in enumerate(docs)))
        from vllm_dp_plugin.config import parse_section, section_from_file

        cfg = parse_section(section_from_file(where / "dp.json"))
        key = NoiseKey(tmp_path / "shared.key")  # one deployment key for both
        sheets = release_fact_sheets(cfg.fact_sheet, key, ReleaseLedger(key, where / "ledger.sqlite"))
        s = FactSheetService(cfg.fact_sheet, sheets)
        app = FastAPI()
        app.add_middleware(PrivateContextGuard)
        app.state.dp_guard, app.state.dp_routes, app.state.dp_fact_sheet = False, allowed_post(
            frozenset({"fact_sheet"})), s

        @app.post("/v1/chat/completions")
        async def chat(body: dict):
            return {"echoed_body": body}

        client = TestClient(app)
        out = {}
        caplog.clear()
        with caplog.at_level(logging.INFO):
            for q in ("How many people work at Ostravo Foods?", "What is the vault code?", "Capital of France?"):
                r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": q}]})
                messages = r.json()["echoed_body"]["messages"]  # lines ordered by noisy count: a DP output
                out[q] = (r.status_code, [sorted(m["content"].splitlines()) for m in messages])
            bad = client.post("/v1/chat/completions", json={"messages": "x"})
            out["error"] = (bad.status_code, bad.json())
        out["log"] = [r.getMessage() for r in caplog.records]
        statement = json.loads(json.dumps(s.statement))
        for c in statement["contexts"]:
            for f in c.get("facts", []):
                f.pop("noisy_count")  # a DP output, as the order it gives the facts and the context's lines
            c["facts"] = sorted(c.get("facts", []), key=str)
            c["context"] = sorted((c.get("context") or "").splitlines())
            c.pop("ledger", None)  # its release time
        out["statement"] = statement
        return out

    docs = collection()
    base = view(docs, tmp_path / "a")
    assert view([d for d in docs if "quendrix42" not in d], tmp_path / "b") == base  # the secret's document
    assert view(docs[1:], tmp_path / "c") == base  # a document stating both facts


def test_per_document_budgets_charge_each_release_to_every_document_it_reads(tmp_path):
    """``per_document_epsilon``: the first release charges each document (once: a restart
    reproduces the same sheet from the recorded reservation, charging nothing more); the release
    of a changed collection charges the documents already released again; a document without room
    for another release is left out of it (cap 10 at eps 4: two releases a document)."""
    from vllm_dp_plugin.config import parse_section, section_from_file
    from vllm_dp_plugin.privacy.document_ledger import DocumentLedger

    def spent(cfg, ids):
        key = NoiseKey(cfg.key_file)
        ledger = DocumentLedger(key, cfg.ledger_store(key))
        return ledger.spent("ostravo", ledger.labels("ostravo", ids))[:, 0].tolist()

    settings = {"per_document_epsilon": 10.0}
    cfg, first = released(tmp_path, **settings)
    ids = [f"d{i}" for i in range(len(collection()))]
    assert spent(cfg, ids) == [4.0] * len(ids)
    _, again = released(tmp_path, **settings)
    assert again["ostravo"].sheet == first["ostravo"].sheet and spent(cfg, ids) == [4.0] * len(ids)
    docs = tmp_path / "ostravo.jsonl"  # a changed collection: one more document, a new release
    docs.write_text(docs.read_text() + json.dumps({"id": "new", "text": "Ostravo opened a new depot."}) + "\n")
    cfg = parse_section(section_from_file(tmp_path / "dp.json"))
    key = NoiseKey(cfg.key_file)
    release_fact_sheets(cfg.fact_sheet, key, ReleaseLedger(key, cfg.ledger_store(key)))
    assert spent(cfg, [*ids, "new"]) == [8.0] * len(ids) + [4.0]
    docs.write_text(docs.read_text() + json.dumps({"id": "newer", "text": "Nothing new."}) + "\n")
    third = release_fact_sheets(cfg.fact_sheet, key, ReleaseLedger(key, cfg.ledger_store(key)))
    assert spent(cfg, [*ids, "new", "newer"]) == [8.0] * len(ids) + [8.0, 4.0]  # the old ones had no room
    assert third["ostravo"].sheet.facts == ()  # it read only the two documents with room left
    statement = fact_sheet_statement_text(cfg)
    assert "budget of each document (its lifetime cap): (eps=10" in statement


def fact_sheet_statement_text(cfg) -> str:
    from vllm_dp_plugin.plan import fact_sheet_report
    from vllm_dp_plugin.reports import fact_sheet_text

    return fact_sheet_text(fact_sheet_report(cfg.fact_sheet, "ostravo"))
