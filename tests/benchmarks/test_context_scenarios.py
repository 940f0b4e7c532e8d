"""`vllm-dp bench context`'s realistic scenarios (issue 48): every shared fact stated by exactly its
support, the asked property stated for other entities too, the secret in one document, the
answers verbatim in the documents that state them, documents of 2-4 sentences behind headers;
the bundled files are the generators' seed 0; a held-out set is one option away."""

import json
import random
import re
from collections import defaultdict

import pytest

from benchmarks.lib.scenario_generator import (
    OTHER_ENTITIES,
    PROPERTIES,
    REALISTIC_DOCUMENTS,
    REALISTIC_FILLERS,
    SECRET_PROPERTIES,
    SUPPORTS,
    make_realistic_scenario,
    make_scenarios,
)
from benchmarks.make_scenarios import main as make_scenarios_main
from vllm_dp_plugin.benchmarks.context import result_stem
from vllm_dp_plugin.benchmarks.lib.scenarios import (
    DEFAULT_SCENARIOS,
    SIMPLE_SCENARIOS,
    answer_in,
    load_scenarios,
)


def _pattern(template: str, **groups: str) -> re.Pattern:
    text = re.escape(template)
    for name, group in groups.items():
        text = text.replace(re.escape("{" + name + "}"), group)
    return re.compile(text + "$", re.IGNORECASE)


STATEMENTS = [(p, _pattern(t, E=r"(?P<E>.+?)", V=r"(?P<V>.+?)")) for p in (*PROPERTIES, *SECRET_PROPERTIES)
              for t in p.statements]
QUESTIONS = [(p, _pattern(p.question, E=r"(?P<E>.+?)")) for p in (*PROPERTIES, *SECRET_PROPERTIES)]
FILLERS = [_pattern(t, C=".+?", S=".+?", T=".+?", P=".+?") for t in REALISTIC_FILLERS]
HEADER = re.compile(r"^(.+?(?::|—)) (.*)$")


def parse(document: str) -> tuple[str, list[tuple[str, str, str] | None]]:
    """(header, per sentence: (property, entity, value) or None for a filler); fails on a
    sentence of neither kind."""
    header, body = HEADER.match(document).groups()
    out = []
    for sentence in re.split(r"(?<=[.!?])\s+", body):
        hit = next(((p.name, m["E"], m["V"]) for p, pat in STATEMENTS if (m := pat.match(sentence))), None)
        assert hit is not None or any(f.match(sentence) for f in FILLERS), sentence
        out.append(hit)
    return header, out


@pytest.fixture(scope="module")
def scenarios():
    return make_scenarios(12, seed=1)


def test_documents_have_headers_and_2_to_4_sentences_with_several_facts(scenarios):
    ids = 0
    for s in scenarios:
        assert len(s["documents"]) == REALISTIC_DOCUMENTS
        facts = []
        for doc in s["documents"]:
            header, sentences = parse(doc)
            assert 2 <= len(sentences) <= 4, doc
            ids += bool(re.search(r"\d", header))
            facts.append(sum(x is not None for x in sentences))
        assert sum(facts) / len(facts) >= 2.5  # several facts a document
    assert ids >= len(scenarios) * REALISTIC_DOCUMENTS // 3  # "Ref HR-2231 | Memo:", "Note 14 —"


def test_support_is_exact_the_asked_property_is_stated_for_other_entities_and_answers_are_verbatim(scenarios):
    harder = 0  # questions whose property another entity has in more documents than the asked one
    for s in scenarios:
        stated = defaultdict(lambda: defaultdict(set))  # property -> entity -> {(document, value)}
        for i, doc in enumerate(s["documents"]):
            for hit in parse(doc)[1]:
                if hit is not None:
                    stated[hit[0]][hit[1]].add((i, hit[2]))
        kinds = [q["kind"] for q in s["questions"]]
        assert kinds.count("secret") == 1 and kinds.count("public") == 2
        assert sorted(q["support"] for q in s["questions"] if q["kind"] == "shared") == list(SUPPORTS)
        for q in s["questions"]:
            if q["kind"] == "public":
                assert q["support"] == 0
                continue
            (prop, entity), = [(p.name, m["E"]) for p, pat in QUESTIONS if (m := pat.match(q["q"]))]
            mine = stated[prop][entity]
            assert {v for _, v in mine} == {q["answers"][0]}  # one value, as the first answer states it
            assert len({d for d, _ in mine}) == len(mine) == q["support"]
            for d, _ in mine:  # verbatim (case included) in each stating document
                assert q["answers"][0] in s["documents"][d]
            stating = [d for d, doc in enumerate(s["documents"]) if any(answer_in(a, doc) for a in q["answers"])]
            assert sorted(stating) == sorted(d for d, _ in mine)  # and no accepted form anywhere else
            others = {e: facts for e, facts in stated[prop].items() if e != entity}
            assert len(others) == OTHER_ENTITIES, (q, others)
            for facts in others.values():
                (value,) = {v for _, v in facts}
                assert not any(answer_in(a, value) for a in q["answers"])
                if q["kind"] == "secret":
                    assert len(facts) == 1  # other sites' codes: one document each too
            harder += max(len(f) for f in others.values()) > q["support"]
            assert not any(answer_in(a, q["q"]) for a in q["answers"])
    assert harder >= len(scenarios)  # the case the member-local key got wrong (issue 48)


def test_answers_are_phrases_with_common_words():
    answers = [q["answers"] for s in load_scenarios(DEFAULT_SCENARIOS) for q in s["questions"]
               if q["kind"] != "public"]
    first = [a[0] for a in answers]
    assert any(re.fullmatch(r"Room \d+", a) for a in first) and any(a.endswith(" am") for a in first)
    assert any(a.startswith("the ") for a in first) and any(re.fullmatch(r"[A-Z][a-z]+ \d+", a) for a in first)
    assert sum(" " in a for a in first) >= len(first) // 2
    assert all(len(set(map(str.lower, a))) >= 1 for a in answers)
    room = next(a for a in answers if a[0].startswith("Room "))
    assert room[:2] == [room[0], room[0].lower()]  # accepted surface forms


def test_other_sizes_work_for_other_users():
    for supports, extra in (((1, 3, 10, 20), 1), ((1, 3, 10, 20), 180), ((20, 100), 100)):
        s = make_realistic_scenario(random.Random(7), 0, supports=supports, extra_docs=extra)
        assert len(s["documents"]) == max(supports) + extra


def test_bundled_files_are_the_generators_seed_0():
    assert load_scenarios(DEFAULT_SCENARIOS) == make_scenarios(24, seed=0)
    assert load_scenarios(SIMPLE_SCENARIOS) == make_scenarios(24, seed=0, style="simple")


def test_a_held_out_set_is_one_option_away_and_its_results_are_named_after_it(tmp_path):
    out = tmp_path / "heldout.jsonl"
    assert make_scenarios_main([str(out), "--seed", "101", "--count", "3"]) == 0
    held = load_scenarios(out)
    assert held == make_scenarios(3, seed=101)
    bundled = make_scenarios(3, seed=0)
    assert not {d for s in held for d in s["documents"]} & {d for s in bundled for d in s["documents"]}
    assert result_stem(tmp_path, False, out, "cpu", "d").name == "context-heldout-cpu-d"
    assert result_stem(tmp_path, True, DEFAULT_SCENARIOS, "cpu", "d").name == "context-quick-cpu-d"
    assert result_stem(tmp_path, False, DEFAULT_SCENARIOS, "cpu", "d").name == "context-cpu-d"
    simple = tmp_path / "simple.jsonl"
    assert make_scenarios_main([str(simple), "--style", "simple", "--count", "2"]) == 0
    assert [json.loads(line) for line in simple.read_text().splitlines()] == make_scenarios(2, style="simple")


def test_documents_fit_the_unit_document_slot():
    from pathlib import Path

    from vllm_dp_plugin.benchmarks.context.rows import DOCUMENT_TOKENS
    from vllm_dp_plugin.benchmarks.lib.scenarios import DEFAULT_MODEL

    tokenizers = pytest.importorskip("tokenizers")
    path = Path(DEFAULT_MODEL) / "tokenizer.json"
    if not path.exists():
        pytest.skip(f"no tokenizer at {DEFAULT_MODEL}")
    tok = tokenizers.Tokenizer.from_file(str(path))
    longest = max(len(tok.encode(d + "\n", add_special_tokens=False).ids)
                  for s in load_scenarios(DEFAULT_SCENARIOS) for d in s["documents"])
    assert longest <= DOCUMENT_TOKENS
