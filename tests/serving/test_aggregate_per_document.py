"""Per-document budgets and reused releases of ``mechanism: answer`` through the service
(engine-free, members that read: ``answer_member: extract``): a query charges only the documents
whose member votes, a document stops taking part at its cap while the service never answers 429,
a question no document answers charges none, a repeated question reuses its release for free
(until the collection changes), and receipts and statements state no sum over documents."""

import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("wordfreq")

from tests.serving.test_aggregate_answer import ALARM, DOCS, INVENTORY, answer_engine
from tests.serving.test_aggregate_leaks import service, tokenizer  # noqa: F401
from vllm_dp_plugin.aggregate.reply import FROM_DOCUMENTS
from vllm_dp_plugin.config import AggregatePrivacyConfig, ConfigError
from vllm_dp_plugin.privacy.partition_selection import ThresholdRelease
from vllm_dp_plugin.reports import aggregate_text

FACT = FROM_DOCUMENTS.format(fact="14 quintember")
SETTINGS = {"mechanism": "answer", "answer_member": "extract", "max_tokens": 16, "answer_tokens": 8,
            "epsilon": 4.0, "per_document_epsilon": 12.0}


def per_document(tmp_path, tokenizer, docs=DOCS, **settings):  # noqa: F811
    return service(tmp_path, tokenizer, docs, answer_engine(tokenizer), **{**SETTINGS, **settings})


def ask(svc, question: str, **xargs) -> tuple[int, dict]:
    body = {"messages": [{"role": "user", "content": question}], **({"vllm_xargs": xargs} if xargs else {})}
    reply = asyncio.run(svc.handle("/v1/chat/completions", body))
    return reply.status_code, json.loads(reply.body)


def spent(svc) -> np.ndarray:
    """Each document's epsilon spent (the operator's view of the ledger), in collection order."""
    return svc.documents.spent("c", svc.document_labels["c"])[:, 0]


def test_only_the_documents_whose_member_votes_are_charged(tmp_path, tokenizer):  # noqa: F811
    svc = per_document(tmp_path, tokenizer)
    status, body = ask(svc, INVENTORY)
    assert status == 200 and body["choices"][0]["message"]["content"] == FACT
    receipt = body["dp_receipt"]
    assert receipt["epsilon"] == 4.0 and "each document whose member voted" in receipt["charged"]
    assert "remaining" not in receipt and not receipt["reused"]
    # the six memos that state the date in one clause (the notes split it at ": ", and abstain)
    np.testing.assert_allclose(spent(svc), [4.0] * 6 + [0.0] * 6)
    assert ask(svc, "What is the capital of France?")[0] == 200  # no document answers: none is charged
    np.testing.assert_allclose(spent(svc), [4.0] * 6 + [0.0] * 6)


def test_a_document_stops_taking_part_at_its_cap_and_no_query_gets_429(tmp_path, tokenizer):  # noqa: F811
    """Cap 12 at eps 4: each of the six voting documents takes part in three answers; from the
    fourth on, none of them votes, nothing is released and nobody is refused."""
    svc = per_document(tmp_path, tokenizer, reuse_answers=False)
    replies = [ask(svc, INVENTORY) for _ in range(5)]
    assert [status for status, _ in replies] == [200] * 5
    assert [body["dp_receipt"]["released"] for _, body in replies] == [True, True, True, False, False]
    np.testing.assert_allclose(spent(svc), [12.0] * 6 + [0.0] * 6)
    assert ask(svc, ALARM)[0] == 200  # the secret's own document still has all of its cap
    assert spent(svc)[10] == 4.0


def test_a_repeated_question_reuses_its_release_free_until_the_collection_changes(tmp_path, tokenizer):  # noqa: F811
    svc = per_document(tmp_path, tokenizer)
    first = ask(svc, INVENTORY)[1]
    again = ask(svc, "  When is the Harlow depot closed  for inventory?")[1]  # the same question, normalised
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"] == FACT
    assert again["dp_receipt"]["reused"] and again["dp_receipt"]["epsilon"] == 0.0
    assert again["dp_receipt"]["noisy_count"] == first["dp_receipt"]["noisy_count"]
    assert isinstance(again["dp_receipt"]["noisy_count"], int)  # as the first receipt wrote it (was 6.0)
    np.testing.assert_allclose(spent(svc), [4.0] * 6 + [0.0] * 6)  # charged once
    other_eps = ask(svc, INVENTORY, dp_epsilon=2.0)[1]["dp_receipt"]  # another epsilon: a new release
    assert not other_eps["reused"]
    np.testing.assert_allclose(spent(svc)[:6], [6.0] * 6)
    restarted = per_document(tmp_path, tokenizer)  # the same store: the release survives a restart
    assert ask(restarted, INVENTORY)[1]["dp_receipt"]["reused"]
    edited = per_document(tmp_path, tokenizer, [*DOCS[:-1], ("other", "Lunch at the Harlow depot is at one.")])
    assert not ask(edited, INVENTORY)[1]["dp_receipt"]["reused"]  # a changed collection answers afresh


def test_reuse_applies_to_the_collection_budget_too(tmp_path, tokenizer):  # noqa: F811
    svc = per_document(tmp_path, tokenizer, per_document_epsilon=None)
    for _ in range(3):
        assert ask(svc, INVENTORY)[0] == 200
    assert svc.ledger.status("c", svc.total).queries == 1


def test_the_statement_states_the_caps_and_no_sum_over_documents(tmp_path, tokenizer):  # noqa: F811
    svc = per_document(tmp_path, tokenizer)
    ask(svc, INVENTORY)
    report = svc.statement(None)["contexts"][0]  # the operator's view: still nothing summed over documents
    assert report["budget"] == {"per_document": {"epsilon": 12.0, "delta": svc.cfg.total_delta}}
    assert report["max_answers_per_document"] == 24 and report["max_queries"] is None  # 12 / min_epsilon 0.5
    assert "ledger" not in report and "individual privacy filter" in report["composition"]
    assert svc.statement(())["scope"].startswith("per document")
    text = aggregate_text(report)
    assert "budget of each document (its lifetime cap): (eps=12," in text and "spent" not in text


@pytest.mark.parametrize(("settings", "key"), [
    ({"mechanism": "vote"}, "aggregate.per_document_epsilon needs mechanism: answer"),
    ({"answer_members": 8}, "aggregate.per_document_epsilon needs mechanism: answer"),
    ({"per_document_epsilon": 2.0}, "aggregate.per_document_epsilon=2 cannot pay for one query"),
    ({"per_document_delta": 1e-7}, "aggregate.per_document_delta=1e-07 is below one query's delta"),
    ({"per_document_epsilon": None, "per_document_delta": 1e-4}, "aggregate.per_document_delta is set without"),
    ({"reuse_answers": "yes"}, "aggregate.reuse_answers must be true or false"),
])
def test_bad_per_document_settings_name_their_key(settings, key):
    with pytest.raises(ConfigError, match=key):
        AggregatePrivacyConfig(contexts={"c": "docs.jsonl"}, **{**SETTINGS, **settings})


# ---------------------------------------------------------------- the filter, audited end to end
PASSPHRASE = "What is the vault passphrase of the Harlow depot?"
ALARM_CODE = "What is the alarm code of the Harlow depot?"
VOTERS, CAP, TAKES_PART = 30, 10.0, 2  # documents stating the passphrase; each one's cap at eps 1; X's share of it
AUDIT_TRIALS, AUDIT_CP, TAIL = 4000, 1e-7, 11
RELEASE = ThresholdRelease.release  # the mechanism itself, under the spy that records its input


def histograms(tmp_path, tokenizer, docs, cap: float, monkeypatch) -> list[dict]:  # noqa: F811
    """The vote counts each query of the adaptive sequence hands to the release, through the
    service: ``CAP - TAKES_PART`` questions only X answers (its alarm code), then ``CAP`` of the
    passphrase, all at eps 1, reuse off."""
    seen = []
    monkeypatch.setattr(ThresholdRelease, "release", lambda self, counts: seen.append(dict(counts)) or
                        RELEASE(self, counts))
    tmp_path.mkdir()
    svc = per_document(tmp_path, tokenizer, docs, epsilon=1.0, per_document_epsilon=cap, reuse_answers=False,
                       total_delta=1e-3)
    for question in [ALARM_CODE] * int(CAP - TAKES_PART) + [PASSPHRASE] * int(CAP):
        assert ask(svc, question)[0] == 200
    return seen


def test_a_document_past_its_cap_is_not_seen_the_filter_audited_through_the_service(tmp_path, tokenizer,  # noqa: F811
                                                                                      monkeypatch):
    """Neighbouring collections, with and without document X (it states the passphrase and its
    own alarm code), under an adaptive sequence: eight questions only X answers, then ten of the
    passphrase that all ``VOTERS`` answer. X's cap (10 at eps 1) leaves it two of the ten, so the
    counts the service hands to the release differ in exactly those (30 against 29), and no event
    of the transcript may be more than e^2 likelier with X (its eight alarm-code answers charged
    too: a cap of 10 in all). Empirically: the event "the released counts of the ten sum to at
    least 29 x 10 + 11" has probabilities 0.025 with X and 0.009 without (log-ratio 1.0); served
    without the filter (a cap of 18: X in all ten) 0.45 (log-ratio 3.9). Clopper-Pearson bounds at
    1e-7 over 4,000 draws of each sequence's releases (the mechanism's own exact sampler, the law
    of ``release``) keep the filtered bound below 2 and put the unfiltered one above it."""
    import math
    from fractions import Fraction

    import torch

    from tests.privacy.test_aggregation import cp_lower, cp_upper
    from vllm_dp_plugin.privacy.noise import discrete_laplace

    x = ("x", ("Memo X: the vault passphrase of the Harlow depot is quorvex. The alarm code of the Harlow depot "
              "is 739182."))
    others = [(f"d{i}", f"Memo {i}: the vault passphrase of the Harlow depot is quorvex.") for i in range(VOTERS - 1)]
    seqs = {"with": histograms(tmp_path / "with", tokenizer, [x, *others], CAP, monkeypatch),
            "without": histograms(tmp_path / "without", tokenizer, others, CAP, monkeypatch),
            "unfiltered": histograms(tmp_path / "unfiltered", tokenizer, [x, *others], 18.0, monkeypatch)}
    pre = int(CAP - TAKES_PART)
    assert seqs["with"][:pre] == [{"739182": 1}] * pre and seqs["without"][:pre] == [{}] * pre
    assert seqs["with"][pre:] == [{"quorvex": VOTERS}] * TAKES_PART + [{"quorvex": VOTERS - 1}] * (int(CAP) - TAKES_PART)
    assert seqs["without"][pre:] == [{"quorvex": VOTERS - 1}] * int(CAP)
    assert seqs["unfiltered"][pre:] == [{"quorvex": VOTERS}] * int(CAP)

    release = ThresholdRelease.calibrated(1.0, 1e-6)
    generator = torch.Generator().manual_seed(0)

    def hits(seq: list[dict]) -> int:
        counts = torch.tensor([h.get("quorvex", 0) for h in seq[pre:]], dtype=torch.int64)
        noise = discrete_laplace(Fraction(release.scale), AUDIT_TRIALS * len(counts), generator)
        noisy = counts + noise.view(AUDIT_TRIALS, len(counts))
        released = torch.where(noisy >= release.threshold, noisy, torch.zeros_like(noisy))
        return int((released.sum(dim=1) >= (VOTERS - 1) * int(CAP) + TAIL).sum())

    seen = {name: hits(seq) for name, seq in seqs.items()}

    def bound(a: str, b: str) -> float:
        return math.log(cp_lower(seen[a], AUDIT_TRIALS, AUDIT_CP) / cp_upper(seen[b], AUDIT_TRIALS, AUDIT_CP))

    assert bound("with", "without") <= TAKES_PART * 1.0, seen  # eps 1 for each of X's two passphrase answers
    assert bound("unfiltered", "without") > TAKES_PART * 1.0, seen


def test_a_lead_in_shares_the_release_of_the_question_it_asks(tmp_path, tokenizer):  # noqa: F811
    """Members that read vote on the question itself (``aggregate.answer.focus``), so "Quick
    question: X?" is answered by X's release, free."""
    svc = per_document(tmp_path, tokenizer)
    first = ask(svc, INVENTORY)[1]["dp_receipt"]
    again = ask(svc, "Quick question: " + INVENTORY)[1]["dp_receipt"]
    assert again["reused"] and again["noisy_count"] == first["noisy_count"]
    np.testing.assert_allclose(spent(svc), [4.0] * 6 + [0.0] * 6)


def test_per_document_budgets_change_no_answer_of_the_bundled_scenarios(tmp_path, tokenizer, monkeypatch):  # noqa: F811
    """The same release noise (a seeded keyed sampler in place of OpenDP's fresh one) gives the
    same reply to every shared and secret question of the bundled realistic scenarios with
    per-document budgets as with one collection total: no document is near its cap, and only
    documents whose member votes are charged, so every vote is counted as before."""
    import torch

    from vllm_dp_plugin.benchmarks.lib.scenarios import DEFAULT_SCENARIOS, load_scenarios

    def seeded(self, counts):
        return self.keyed_release(counts, torch.Generator().manual_seed(len(counts) * 7919 + sum(counts.values())))

    monkeypatch.setattr(ThresholdRelease, "release", seeded)
    replies = {}
    for scenario in load_scenarios(DEFAULT_SCENARIOS)[:8]:
        docs = [(f"d{i}", text) for i, text in enumerate(scenario["documents"])]
        questions = [q["q"] for q in scenario["questions"] if q["kind"] != "public"]
        for name, budget in (("collection", {"per_document_epsilon": None}), ("document", {})):
            where = tmp_path / f"{scenario['id']}-{name}"
            where.mkdir()
            svc = per_document(where, tokenizer, docs, on_empty="refuse", reuse_answers=False, **budget)
            replies[name, scenario["id"]] = [ask(svc, q)[1]["choices"][0]["message"]["content"] for q in questions]
    for (name, sid), got in replies.items():
        assert got == replies["collection", sid], sid
    assert sum(r.startswith("From the documents") for (n, _), rs in replies.items() if n == "document" for r in rs) > 10
