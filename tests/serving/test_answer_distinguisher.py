"""An empirical lower bound on what one query of ``mechanism: answer`` spends, through the
service (engine-free: ``FakeEngine`` writes each member's answer from its documents), for
neighbouring collections one document apart.

With ``answer_members`` a member holds several documents, so removing one can switch its
member's vote from one key to another: two counts move (l0 = 2). Here the member that holds
both an ``ALPHA`` and a ``BETA`` document answers ALPHA, and without its ALPHA document
BETA: the counts go from (41, 40) to (40, 41). A client sees the released fact and its noisy
count (the receipt); the event "ALPHA is released, at 41" is chosen in advance from the exact
law. At eps 1 under the l0 = 1 calibration (the bug) its probabilities are 0.338 and 0.046
(log-ratio 2.0), under the l0 = 2 one 0.152 and 0.056 (log-ratio 1.0: the bound is tight).
Clopper-Pearson bounds at 1e-7 on each side over N queries per collection keep the honest
log-ratio below the receipt's epsilon (false failure < 4e-7) and put the l0 = 1 calibration
above it (its expected lower bound at N = 1,500: 1.24); today's code failed this test."""

import asyncio
import functools
import json
import math

import pytest

pytest.importorskip("vllm")
pytest.importorskip("wordfreq")
pytest.importorskip("opendp")

from tests.privacy.test_aggregation import cp_lower, cp_upper
from tests.serving.fake_engine import FakeEngine
from tests.serving.test_aggregate_leaks import MAX_MODEL_LEN, service, tokenizer  # noqa: F401
from vllm_dp_plugin.aggregate.documents import Collection, Document
from vllm_dp_plugin.privacy.keyed_noise import NoiseKey
from vllm_dp_plugin.privacy.partition_selection import ThresholdRelease

QUESTION = "What is the vault passphrase?"
ALPHA, BETA = "quorvex", "zembrila"
MEMBERS, VOTES = 128, 41  # answer_members; members voting ALPHA in the larger collection (BETA: one less)
EPSILON, ALPHA_CP, N = 1.0, 1e-7, 1500


def writer(tok):
    """A member names ALPHA when one of its documents does, else BETA, else NONE (a stand-in
    for a model that reads its documents in order); the public answer says it does not know."""

    @functools.cache
    def decoded(ids: tuple[int, ...]) -> str:
        return tok.decode(ids)

    def write(ids: list[int]) -> str:
        text = decoded(tuple(ids))
        if "Document:" not in text:
            return "I don't know"
        documents = text.split("Document:")[1].split("Answer the user's question")[0]
        return next((w for w in (ALPHA, BETA) if w in documents), "NONE")

    return write


def collections(key: NoiseKey) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Neighbouring collections under ``key``'s grouping: every member holds only ALPHA or only
    BETA documents but one, which holds one of each; the smaller collection lacks that ALPHA
    document. Texts are chosen after the grouping (a keyed hash of the ids alone)."""
    ids = [f"d{i}" for i in range(200)]
    parts = Collection("c", tuple(Document(i, "") for i in ids)).partition(
        MEMBERS, lambda doc_id: key.mac("aggregate/member", "c", doc_id))
    filled = [p for p in parts if p]
    target = next(p for p in filled if len(p) >= 2)
    others = [p for p in filled if p is not target]
    assert len(others) >= 2 * VOTES - 2
    text = {}
    for k, part in enumerate(others):
        word = ALPHA if k < VOTES - 1 else BETA if k < 2 * VOTES - 2 else None
        for doc in part:
            text[doc.id] = (f"The passphrase is {word}." if word
                            else "Lunch at noon.")
    removed = target[0].id
    text[removed] = f"The passphrase is {ALPHA}."
    for doc in target[1:]:
        text[doc.id] = f"The passphrase is {BETA}."
    larger = [(i, text[i]) for i in ids]
    return larger, [d for d in larger if d[0] != removed]


def receipts(svc, n: int) -> list[dict]:
    async def run():
        body = {"messages": [{"role": "user", "content": QUESTION}]}
        return [json.loads((await svc.handle("/v1/chat/completions", body)).body)["dp_receipt"] for _ in range(n)]

    return asyncio.run(run())


def test_one_document_moving_two_counts_stays_within_the_receipts_epsilon(tmp_path, tokenizer):  # noqa: F811
    (tmp_path / "noise.key").write_bytes(bytes(range(32)))
    (tmp_path / "noise.key").chmod(0o600)
    larger, smaller = collections(NoiseKey(tmp_path / "noise.key"))
    seen = {}
    for name, docs in (("larger", larger), ("smaller", smaller)):
        engine = FakeEngine(len(tokenizer), MAX_MODEL_LEN, write=writer(tokenizer), eos=tokenizer.eos_token_id,
                            encode=functools.partial(tokenizer.encode, add_special_tokens=False))
        svc = service(tmp_path, tokenizer, docs, engine, mechanism="answer", answer_members=MEMBERS,
                      epsilon=EPSILON, total_epsilon=10 * N, total_delta=0.5, max_tokens=4, answer_tokens=8,
                      max_member_tokens=MAX_MODEL_LEN // 2, reuse_answers=False)
        got = receipts(svc, N)
        seen[name] = sum(r["fact"] == ALPHA and r["noisy_count"] == VOTES for r in got)
        receipt_eps = max(r["epsilon"] for r in got)
    assert receipt_eps <= EPSILON
    lower = math.log(cp_lower(seen["larger"], N, ALPHA_CP) / cp_upper(seen["smaller"], N, ALPHA_CP))
    assert lower <= receipt_eps, seen
    # the same counts under the l0 = 1 calibration (the bug): caught by the same bound
    r = ThresholdRelease.calibrated(EPSILON, 1e-6, 1)
    mutant = {name: sum(_top(r.release(c)) == (ALPHA, VOTES) for _ in range(N))
              for name, c in (("larger", {ALPHA: VOTES, BETA: VOTES - 1}), ("smaller", {ALPHA: VOTES - 1, BETA: VOTES}))}
    assert math.log(cp_lower(mutant["larger"], N, ALPHA_CP) / cp_upper(mutant["smaller"], N, ALPHA_CP)) > EPSILON


def _top(released: dict[str, int]) -> tuple[str, int] | None:
    """The service's choice: the most agreed key (ties: the later key) and its noisy count."""
    return max(((k, v) for k, v in released.items()), key=lambda kv: (kv[1], kv[0])) if released else None
