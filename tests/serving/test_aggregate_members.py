"""DP aggregation's private path, engine-free: a fake engine records the token
ids of every sub-request ``AggregateService`` sends. The members' prompts hold exactly their
documents (each document in one member's prompt, in no other and not in the public one; each
member's prompt is the chat template over its own documents and the conversation), changing,
removing or adding one document changes that one member's prompt only, the answer is what the
members say (at a huge epsilon, one member's greedy continuation, not the public one's), and a
seeded query (``AggregateService.rng``) is reproducible to the byte."""

import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("vllm")

from tests.serving.fake_engine import FakeEngine
from vllm_dp_plugin.config import AggregatePrivacyConfig
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
from vllm_dp_plugin.privacy.ledger_store import open_store
from vllm_dp_plugin.serving.aggregate import AggregateService

MAX_MODEL_LEN = 1024
DOCS = {f"memo-{i}": f"Memo {i}: depot {i} of Harlow Freight closes at {i % 12 + 1} pm." for i in range(12)}
QUESTION = [{"role": "user", "content": "When does depot 3 close?"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from vllm_dp_plugin.demo import make_demo_llama

    return AutoTokenizer.from_pretrained(make_demo_llama(tmp_path_factory.mktemp("demo") / "llama"))


def fixed_key(tmp_path) -> NoiseKey:
    """One fixed key (a fresh random one would leave a member without documents in ~13% of runs:
    4 x (3/4)^12); neighbouring collections under it get the same partition of what they share."""
    path = tmp_path / "noise.key"
    if not path.exists():
        path.write_bytes(bytes(range(32)))
        path.chmod(0o600)
    return NoiseKey(path)


def service(tmp_path, tokenizer, docs: dict[str, str], tag: str, **settings) -> AggregateService:
    """A service over ``docs`` (id -> text) under ``fixed_key``, its files in ``tmp_path/tag``."""
    where = tmp_path / tag
    where.mkdir()
    path = where / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in docs.items()))
    settings = {"members": 4, "epsilon": 4.0, "total_epsilon": 400.0, "max_tokens": 4, **settings}
    cfg = AggregatePrivacyConfig(contexts={"c": str(path)}, **settings)
    return AggregateService(cfg, FakeEngine(len(tokenizer), MAX_MODEL_LEN), tokenizer, fixed_key(tmp_path), "m",
                            (tokenizer.eos_token_id,), MAX_MODEL_LEN, open_store(where / "ledger.sqlite"))


def answer(svc: AggregateService, path: str, body: dict) -> dict:
    reply = asyncio.run(svc.handle(path, body))
    assert reply.status_code == 200, reply.body
    return json.loads(reply.body)


def first_step(svc: AggregateService) -> list[list[int]]:
    """One chat query's first engine step: [public, member 1, ..., member k] token ids (sub-request
    ``dpagg-<batch>-<i>``: i = 0 is the public sequence)."""
    answer(svc, CHAT, {"messages": QUESTION})
    calls = svc.source.engine.calls
    batch = calls[0]["request_id"].rsplit("-", 1)[0]
    step = {int(c["request_id"].rsplit("-", 1)[1]): c["ids"] for c in calls if c["request_id"].startswith(batch + "-")}
    assert sorted(step) == list(range(svc.cfg.members + 1))
    return [step[i] for i in sorted(step)]


def rendered(tokenizer, system: str | None) -> str:
    """The chat template over (a system turn holding ``system``, the question), as text."""
    turns = QUESTION if system is None else [{"role": "system", "content": system}, *QUESTION]
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


def test_each_document_is_in_exactly_one_members_prompt_and_each_member_holds_only_its_own(tmp_path, tokenizer):
    """Would fail if members saw no documents, all of them, another member's, or the public
    sequence saw any: each member's prompt is exactly the template over its own documents (in
    source order, one a line) and the question; the public prompt is the template over the
    question alone."""
    public, *members = [tokenizer.decode(ids) for ids in first_step(service(tmp_path, tokenizer, DOCS, "all"))]
    assert public == rendered(tokenizer, None)
    holders = {doc_id: [i for i, prompt in enumerate(members) if text in prompt] for doc_id, text in DOCS.items()}
    assert all(len(h) == 1 for h in holders.values()), holders
    for i, prompt in enumerate(members):
        own = [text for doc_id, text in DOCS.items() if holders[doc_id] == [i]]
        assert own  # 12 documents reach all 4 members: "only its own" is not vacuous
        assert prompt == rendered(tokenizer, "\n".join(own))


@pytest.mark.parametrize("neighbour", ["changed", "removed", "added"])
def test_one_document_changed_removed_or_added_changes_only_its_members_prompt(tmp_path, tokenizer, neighbour):
    """The unit's neighbours through the whole service (JSONL ids, keyed partition, template,
    tokenization): the first step's public prompt and every other member's prompt are the same
    token ids; the one member that holds the document differs."""
    docs = dict(DOCS)
    if neighbour == "changed":
        docs["memo-5"] = "Memo 5: depot 5 of Harlow Freight is closed for inventory."
    elif neighbour == "removed":
        del docs["memo-5"]
    else:
        docs["memo-new"] = "Memo 12: depot 12 of Harlow Freight opens in May."
    base = first_step(service(tmp_path, tokenizer, DOCS, "base"))
    other = first_step(service(tmp_path, tokenizer, docs, neighbour))
    assert other[0] == base[0]
    changed = [i for i in range(1, len(base)) if other[i] != base[i]]
    text = DOCS["memo-5"] if neighbour != "added" else docs["memo-new"]
    holder = [i for i in range(1, len(base)) if text in tokenizer.decode((other if neighbour == "added" else base)[i])]
    assert changed == holder and len(holder) == 1


def greedy(engine: FakeEngine, ids: list[int], steps: int, stop: int) -> list[int]:
    """The fake engine's greedy continuation of ``ids`` (up to a stop token, included)."""
    ids, out = list(ids), []
    for _ in range(steps):
        out.append(int(np.argmax(engine.logprobs(ids))))
        if out[-1] == stop:
            break
        ids.append(out[-1])
    return out


def test_the_answer_is_what_the_members_say(tmp_path, tokenizer):
    """End to end, the private path decides the answer: one member holding every document, vote
    without a gate at epsilon 1e6 per query (eps_select 2.5e5 per token: a vote outweighs any prior
    and the noise), so every token is the member's greedy one: the answer is the member's greedy
    continuation, which here differs from the public sequence's."""
    svc = service(tmp_path, tokenizer, DOCS, "one", members=1, gate="none", epsilon=1e6, total_epsilon=1e7)
    svc.rng = lambda: np.random.default_rng(0)
    public, member = first_step(svc)
    engine, stop = svc.source.engine, tokenizer.eos_token_id
    reply = answer(svc, CHAT, {"messages": QUESTION})
    said = [t for t in greedy(engine, member, 4, stop) if t != stop]
    assert reply["choices"][0]["message"]["content"] == tokenizer.decode(said, skip_special_tokens=True)
    assert greedy(engine, member, 4, stop) != greedy(engine, public, 4, stop)
    assert reply["dp_receipt"]["private_tokens"] == min(4, len(said) + (len(said) < 4))


def test_a_seeded_query_is_reproducible_to_the_byte(tmp_path, tokenizer):
    """Two deployments of the same documents and key, each query seeded alike: the same answers
    and receipts (the SVT gate is on, so what a query spends depends on its sampled path); fresh
    seeds (the default) give other answers, so the seed is what makes them equal."""

    def run(tag: str, seeded: bool) -> list:
        svc = service(tmp_path, tokenizer, DOCS, tag, max_tokens=8)
        if seeded:
            svc.rng = lambda: np.random.default_rng(42)
        out = []
        for path, body in [(CHAT, {"messages": QUESTION}), ("/v1/completions", {"prompt": "Depot 3 closes at"})]:
            reply = answer(svc, path, body)
            out.append({k: v for k, v in reply.items() if k not in ("id", "created")})
        return out

    first = run("a", seeded=True)
    assert run("b", seeded=True) == first
    assert any(r["dp_receipt"]["private_tokens"] for r in first)
    assert [run(f"fresh-{i}", seeded=False) for i in range(2)] != [first, first]
