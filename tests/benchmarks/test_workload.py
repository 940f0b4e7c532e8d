"""``python -m benchmarks.workload`` without a server: the stream (seeded, mixed, repeats word for word,
many distinct general questions), each budget mode's configuration, and the report."""

from collections import Counter

from benchmarks import workload
from vllm_dp_plugin.config import parse_section


def test_the_stream_is_seeded_mixed_and_repeats_earlier_questions_word_for_word():
    questions = workload.stream(1000, 0)
    assert questions == workload.stream(1000, 0) and questions != workload.stream(1000, 1)
    kinds = Counter(q.kind for q in questions if not q.repeat)
    assert {"public", "off_topic", "collection", "secret"} == set(kinds)
    repeats = [q for q in questions if q.repeat]
    assert 150 <= len(repeats) <= 250
    seen = set()
    for q in questions:
        assert not q.repeat or q.text in seen
        seen.add(q.text)
    assert all(q.answer in workload.COLLECTION for q in questions if q.kind == "collection")
    assert len({q.text for q in questions if q.kind == "public"}) > 100  # a real stream's variety


def test_each_budget_mode_serves_the_example_with_its_budget(tmp_path):
    per_document = parse_section(workload.section("per_document", tmp_path / "k")).aggregate
    assert per_document.per_document and per_document.reuse_answers
    per_collection = parse_section(workload.section("per_collection", tmp_path / "k")).aggregate
    assert not per_collection.per_document and not per_collection.reuse_answers
    assert per_collection.total_epsilon == 200.0


def test_the_report_states_both_modes():
    rows = [{"mode": "per_document", "questions": 2, "status": {"200": 2}, "refused_429": 0,
             "answered_from_documents": 1, "reused": 1, "dropped_out": 0, "documents": 22,
             "largest_document_spend_epsilon": 4.0, "cap_epsilon": 40.0, "seconds_per_question": 0.3,
             "by_kind": {k: {"questions": 1, "ok": 1, "released": 0, "right": 0, "reused": 0}
                         for k in ("collection", "secret", "public", "off_topic")}}]
    meta = {"label": "cpu-2core", "date": "2026-11-29", "command": "python -m benchmarks.workload", "model": "m",
            "questions": 2, "seed": 0, "kinds": workload.KINDS, "concurrency": 4, "max_tokens": 24}
    text = workload.markdown(meta, rows)
    assert "| per_document | 2 | 2 | 0 | 1 | 0 / 1 |" in text and "0 of 22" in text and "4 (cap 40)" in text
