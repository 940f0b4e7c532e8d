"""`vllm-dp bench context`'s scoring of what `aggregate_answer` releases and says (issue 48), on
hand-written replies: a right release, a wrong one, a fragment, an unmarked fallback, a reply that
adds a date; the row's rates, the report's columns, and older result files still read."""

import json

import pytest

from vllm_dp_plugin.aggregate.reply import GENERAL_KNOWLEDGE, NOT_FROM_DOCUMENTS
from vllm_dp_plugin.benchmarks.context import kept_rows
from vllm_dp_plugin.benchmarks.context.report import describe, markdown
from vllm_dp_plugin.benchmarks.context.scoring import (
    ROW_KEYS,
    Answer,
    fallback_marked,
    norm_words,
    release_class,
    sample,
    score,
    specifics,
    summarize,
    unfit,
    unsupported,
)
from vllm_dp_plugin.benchmarks.lib.scenarios import is_correct

ROOM = ["Room 12", "room 12"]
ROLE = ["the regional manager", "regional manager"]
MARKED = f"{NOT_FROM_DOCUMENTS} {GENERAL_KNOWLEDGE} The capital of France is Paris."
SCENARIO = {"id": "s0", "documents": ["Ref HR-2231 | Memo: The Brakford quarterly review is held in Room 12."]}
Q_ROOM = {"q": "In which room is the Brakford quarterly review held?", "answers": ROOM, "kind": "shared",
          "support": 10}
Q_ROLE = {"q": "Who approves travel expenses at Brakford?", "answers": ROLE, "kind": "shared", "support": 3}
Q_CODE = {"q": "What is the alarm code of the Brakford back door?", "answers": ["775845"], "kind": "secret",
          "support": 1}
Q_PUBLIC = {"q": "What is the capital of France?", "answers": ["Paris"], "kind": "public", "support": 0}


def receipt(fact):
    return {"released": fact is not None, "fact": fact, "noisy_count": None if fact is None else 7}


@pytest.mark.parametrize(("fact", "answers", "expected"), [
    ("Room 12", ROOM, "right"), ("room 12.", ROOM, "right"), ("the room 12 on floor 2", ROOM, "right"),
    ("regional manager", ROLE, "right"), ("The Regional Manager", ROLE, "right"),
    ("september 14th", ["September 14"], "right"), ("8 a.m.", ["8 am"], "right"), ("2,718", ["2718"], "right"),
    ("12", ROOM, "fragment"), ("room", ROOM, "fragment"), ("regional", ROLE, "fragment"),
    ("manager", ROLE, "fragment"), ("talven", ["Talven Orsk", "Orsk"], "fragment"), ("8", ["8:30 am"], "fragment"),
    ("room 22", ROOM, "wrong"), ("22", ROOM, "wrong"), ("note", ROOM, "wrong"), ("westgate", ROOM, "wrong"),
    ("general manager", ROLE, "wrong"), ("the", ROLE, "wrong"), ("120", ROOM, "wrong"),
    (None, ROOM, "none"),
])
def test_release_classes(fact, answers, expected):
    assert release_class(fact, answers) == expected


def test_words_are_compared_case_and_punctuation_insensitive():
    assert norm_words("Room 12.") == norm_words("room 12") == ["room", "12"]
    assert norm_words("8 a.m.") == norm_words("8am") == ["8", "am"]
    assert norm_words("2,718 on September 14th") == ["2718", "on", "september", "14"]


def test_specifics_are_numbers_dates_and_names_not_starting_a_sentence():
    text = "From the documents: september 14. The opening date can vary, around 14:30 EST on December"
    assert specifics(text) == ["september", "14", "14", "30", "est", "december"]
    assert unsupported(text, ["When is Seattle closed for inventory?", "september 14"]) == ["30", "est", "december"]
    assert specifics("The Brakford review. I think it is Monday.") == ["brakford", "monday"]  # "The", "I": no
    assert specifics("It starts at 8 AM, ok?") == ["8"]
    assert unsupported("The Brakford review is in Room 12.", [Q_ROOM["q"]]) == ["12"]  # "Room": the question's
    assert unsupported("The alarm code of the Brakf", [Q_CODE["q"]]) == []  # cut mid-word: Brakford's start
    assert unsupported("The code is 7758", ["code 775845"]) == ["7758"]  # numbers match whole
    assert unsupported("Ask Bra", ["Brakford"]) == ["bra"]  # 3 letters are too few


def test_fallbacks_must_say_they_are_not_from_the_documents():
    assert fallback_marked(NOT_FROM_DOCUMENTS)
    assert fallback_marked(MARKED)
    assert fallback_marked("  " + MARKED)
    assert not fallback_marked("The capital of France is Paris.")  # today's public answer
    assert not fallback_marked(f"{NOT_FROM_DOCUMENTS} The capital of France is Paris.")  # public answer unmarked
    assert not fallback_marked(f"{GENERAL_KNOWLEDGE} {NOT_FROM_DOCUMENTS}")


def test_score_hand_written_replies():
    right = score(SCENARIO, Q_ROOM, "From the documents: Room 12.", receipt("Room 12"))
    assert right.correct and right.release == "right" and right.unsupported == () and right.marked is None
    wrong = score(SCENARIO, Q_ROOM, "From the documents: room 22.", receipt("room 22"))
    assert not wrong.correct and wrong.release == "wrong" and wrong.unsupported == ()  # 22 is the release's
    fragment = score(SCENARIO, Q_ROLE, "From the documents: regional.", receipt("regional"))
    assert not fragment.correct and fragment.release == "fragment"
    date = score(SCENARIO, Q_ROOM, "From the documents: Room 12. The review moves to Room 14 on October 3.",
                 receipt("Room 12"))
    assert date.correct and date.release == "right" and date.unsupported == ("14", "october", "3")
    unmarked = score(SCENARIO, Q_ROLE, "The regional manager for the West Coast is Kenny McCaffer.",
                     receipt(None))
    assert unmarked.release == "none" and unmarked.marked is False and unmarked.fact is None
    assert unmarked.correct and unmarked.unsupported == ("west", "coast", "kenny", "mccaffer")
    marked = score(SCENARIO, Q_CODE, f"{NOT_FROM_DOCUMENTS}", receipt(None))
    assert marked.marked is True and not marked.correct and marked.unsupported == ()
    plain = score(SCENARIO, Q_ROOM, "It is held in Room 12.")  # no receipt: rows without a release
    assert plain.release is None and plain.marked is None and plain.unsupported == ("12",)
    full = score(SCENARIO, Q_ROOM, "It is held in Room 12 (HR-2231).", None, SCENARIO["documents"])
    assert full.unsupported == ()  # `full`: the documents are in its prompt
    vote = score(SCENARIO, Q_ROOM, "Room 12", {"private_tokens": 3})  # a token-level receipt: no release
    assert vote.release is None


def test_the_row_reports_release_fallback_and_specific_rates():
    answers = [
        score(SCENARIO, Q_ROOM, "From the documents: Room 12.", receipt("Room 12")),
        score(SCENARIO, Q_ROOM, "From the documents: room 22.", receipt("room 22")),
        score(SCENARIO, Q_ROLE, "From the documents: regional.", receipt("regional")),
        score(SCENARIO, Q_ROLE, "Kenny McCaffer approves them.", receipt(None)),  # unmarked, invents
        score(SCENARIO, Q_CODE, NOT_FROM_DOCUMENTS, receipt(None)),
        score(SCENARIO, Q_CODE, "From the documents: 123456.", receipt("123456")),  # another site's code
        score(SCENARIO, Q_PUBLIC, MARKED, receipt(None)),
    ]
    row = summarize("aggregate_answer", 4.0, answers, 7.0)
    assert tuple(row) == ROW_KEYS
    assert row["wrong_release_rate"] == {"shared": 0.25, "secret": 0.5}
    assert row["fragment_rate"] == {"shared": 0.25, "secret": 0.0}
    assert row["n_fallbacks"] == 3 and row["fallback_unmarked_rate"] == pytest.approx(1 / 3)
    assert row["fallback_specific_rate"] == 0.5  # of the 2 collection fallbacks; public left out
    assert row["unsupported_specific_rate"] == pytest.approx(1 / 6)  # Kenny McCaffer; Paris is public
    assert row["releases"]["10"] == {"right": 1, "fragment": 0, "wrong": 1, "none": 0}
    assert row["releases"]["3"] == {"right": 0, "fragment": 1, "wrong": 0, "none": 1}
    assert row["releases"]["secret"] == {"right": 0, "fragment": 0, "wrong": 1, "none": 1}
    assert row["releases"]["public"]["none"] == 1
    json.dumps(row)
    plain = summarize("full", None, [score(SCENARIO, Q_ROOM, "Room 12")], 1.0)
    assert plain["wrong_release_rate"] is None and plain["fallback_unmarked_rate"] is None
    assert plain["releases"] is None and plain["unsupported_specific_rate"] == 1.0
    assert tuple(unfit("x", None, "why")) == (*ROW_KEYS, "note")
    assert "wrong release 0.25 / 0.50 fragment 0.25 / 0.00" in describe(row)
    assert sample("aggregate_answer", 4.0, answers[1])["release"] == "wrong"


def _data(rows, samples=()):
    return {"device": "cpu-2core", "date": "d", "command": "vllm-dp bench context", "model": "m",
            "scenarios": "s.jsonl", "n_scenarios": 1, "question_counts": {"shared": 4, "secret": 1, "public": 2},
            "max_tokens": 32, "concurrency": 8, "rows": rows, "budgets": [], "sample_answers": list(samples)}


def test_markdown_shows_the_new_columns_and_reads_rows_of_older_files():
    answers = [score(SCENARIO, Q_ROOM, "From the documents: room 22.", receipt("room 22")),
               score(SCENARIO, Q_CODE, "Ask Kenny McCaffer, he knows it: 4711.", receipt(None))]
    new = summarize("aggregate_answer", 4.0, answers, 2.0)
    old = {"row": "none", "eps": None, "shared_accuracy": {"10": 0.0}, "secret_leak_rate": 0.0,
           "public_accuracy": 1.0, "seconds_per_answer": 0.4, "n_questions": 7}  # written before issue 48
    text = markdown(_data([old, new], [sample("aggregate_answer", 4.0, a) for a in answers]))
    assert "| none |  | 0.00 | 0.00 | 1.00 |  |  |  |  |  | 0.400 | 7 |" in text
    assert "| aggregate_answer | 4 | 0.00 | 0.00 |  | 1.00 / 0.00 | 0.00 / 0.00 | 0.50 | 1.00 | 1.00 (1) |" in text
    assert "| aggregate_answer | 4 | 0 / 0 / 1 / 0 |" in text  # support 10: one wrong release
    assert "| aggregate_answer | 4 | wrong | In which room is the Brakford quarterly review held? | room 22 |" in text
    assert "| aggregate_answer | 4 | nothing released |" in text and "kenny, mccaffer, 4711" in text
    assert "{" not in text


def test_append_refuses_a_file_of_other_scenarios_content(tmp_path):
    path = tmp_path / "r.json"
    old = {"model": "m", "scenarios": "s.jsonl", "max_tokens": 32, "command": "first", "earlier_commands": [],
           "rows": [], "budgets": [], "sample_answers": [], "scenarios_sha256": "aaa"}
    path.write_text(json.dumps(old))
    assert kept_rows(path, "m", "s.jsonl", 32, [], "aaa")["commands"] == ["first"]
    with pytest.raises(SystemExit, match="scenarios_sha256"):
        kept_rows(path, "m", "s.jsonl", 32, [], "bbb")
    del old["scenarios_sha256"]  # written before the digest (2026-11-28): read as it is
    path.write_text(json.dumps(old))
    assert kept_rows(path, "m", "s.jsonl", 32, [], "bbb")["commands"] == ["first"]


def test_correct_is_a_whole_phrase():
    assert is_correct("It is held in room 12.", ROOM)
    assert not is_correct("It is held in Room 120.", ROOM)
    assert not is_correct("It lasts 12 years.", ["2 years"])
    assert is_correct("Ask Orsk's office.", ["Orsk"]) and is_correct("$1,250 each", ["$1,250"])
    # the same words apart from punctuation: what the mechanism's normalised keys look like
    assert is_correct("From the documents: 8 30 am.", ["8:30 am"]) and is_correct("on September 14th", ["September 14"])
    assert is_correct("at 8 a.m.", ["8 am"]) and not is_correct("at 8 30 pm", ["8:30 am"])
    assert not is_correct("From the documents: 8 30.", ["8:30 am"])  # a fragment is not the answer


def test_an_answer_without_a_receipt_keeps_the_old_fields():
    a = Answer("s0", "shared", 3, True, "x")
    assert a.release is None and a.unsupported == () and a.marked is None
