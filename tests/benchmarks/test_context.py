"""`vllm-dp bench context`: the scenario generator, the scorer, the token layout every row shares,
the row registry and the result schema; `--quick` end to end (rows none, full) on the demo model."""

import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.context_speed import answer_speed_markdown
from benchmarks.lib.scenario_generator import (
    SUPPORTS,
    make_scenario,
    make_scenarios,
    write_scenarios,
)
from benchmarks.make_scenarios import main as make_scenarios_main
from vllm_dp_plugin.benchmarks.context import kept_rows, running
from vllm_dp_plugin.benchmarks.context.report import markdown, plot
from vllm_dp_plugin.benchmarks.context.rows import ROWS, dp_request
from vllm_dp_plugin.benchmarks.context.running import Bench, jobs_of, run, server_parts
from vllm_dp_plugin.benchmarks.context.scoring import ROW_KEYS, Answer, summarize, unfit
from vllm_dp_plugin.benchmarks.lib.scenarios import (
    DEFAULT_SCENARIOS,
    ChatLayout,
    check_scenario,
    is_correct,
    load_scenarios,
)
from vllm_dp_plugin.cli import main


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from vllm_dp_plugin.demo import make_demo_llama

    return make_demo_llama(tmp_path_factory.mktemp("context-bench") / "llama")


# --------------------------------------------------------------------------- generator
def test_generator_is_deterministic_in_its_seed():
    assert make_scenarios(3, seed=5) == make_scenarios(3, seed=5)
    assert make_scenarios(3, seed=5) != make_scenarios(3, seed=6)


def test_generated_facts_are_stated_by_exactly_their_support():
    """The simple style (the speed benches' and the attention ladder's collections); the realistic
    one: test_context_scenarios.py."""
    for s in make_scenarios(12, seed=1, style="simple"):
        docs = [d.lower() for d in s["documents"]]
        kinds = [q["kind"] for q in s["questions"]]
        assert kinds.count("secret") == 1 and kinds.count("public") >= 1
        assert sorted(q["support"] for q in s["questions"] if q["kind"] == "shared") == list(SUPPORTS)
        assert 20 <= len(docs) <= 30
        for doc in s["documents"]:  # a label and 1-2 short sentences
            assert 1 <= len(re.findall(r"[.!?](?:\s|$)", doc)) <= 2 and not re.search(r"\d", doc.split(":")[0])
        for q in s["questions"]:
            stating = [d for d in docs if q["answers"][0].lower() in d]
            mentioning = [d for d in docs if any(a.lower() in d for a in q["answers"])]
            if q["kind"] == "public":
                assert q["support"] == 0
                continue
            assert len(stating) == len(mentioning) == q["support"], (s["id"], q)
            assert q["support"] == 1 if q["kind"] == "secret" else q["support"] in SUPPORTS
            assert q["answers"][0].lower() not in q["q"].lower()  # the question does not give it away


def test_bundled_scenarios_are_the_generators_seed_0():
    scenarios = load_scenarios(DEFAULT_SCENARIOS)
    assert len(scenarios) == 24
    assert scenarios == make_scenarios(24, seed=0)


def test_check_scenario_refuses_a_wrong_support(tmp_path):
    s = make_scenarios(1, seed=2)[0]
    shared = next(q for q in s["questions"] if q["support"] == 3)
    shared["support"] = 10
    with pytest.raises(ValueError, match="stated by 3 documents"):
        check_scenario(s)
    bad = tmp_path / "dup.jsonl"
    write_scenarios([make_scenarios(1, seed=2)[0]] * 2, bad)
    with pytest.raises(ValueError, match="duplicate"):
        load_scenarios(bad)


def test_make_scenarios_option_writes_a_loadable_file(tmp_path):
    out = tmp_path / "s.jsonl"
    assert make_scenarios_main([str(out), "--count", "3", "--seed", "4"]) == 0
    assert load_scenarios(out) == make_scenarios(3, seed=4)


# --------------------------------------------------------------------------- scorer
class WordTokenizer:
    """One token per space-separated word."""

    def encode(self, text, add_special_tokens=False):
        return text.split(" ")

    def decode(self, ids):
        return " ".join(ids)


def test_scorer_is_a_case_insensitive_substring_within_32_tokens():
    assert is_correct("The CEO is Talven ORSK.", ["Orsk"])
    assert is_correct("It has 4,817 staff", ["4817", "4,817"])
    assert not is_correct("It has 4817 staff", ["Orsk"])
    late = " ".join(["word"] * 32 + ["Orsk"])
    assert is_correct(late, ["orsk"])  # a completion is already at most 32 tokens long
    assert not is_correct(late, ["orsk"], tokenizer=WordTokenizer())
    assert is_correct(" ".join(["word"] * 31 + ["Orsk"]), ["orsk"], tokenizer=WordTokenizer())


def test_summary_rows_have_exactly_the_schema_keys():
    A = Answer
    answers = [A("s0", "shared", 3, True, ""), A("s0", "shared", 3, False, ""), A("s0", "shared", 20, True, ""),
               A("s0", "secret", 1, True, ""), A("s0", "public", 0, False, ""), A("s1", "public", 0, True, "")]
    row = summarize("dp_state", 8.0, answers, 3.0)
    assert tuple(row) == ROW_KEYS
    assert row["shared_accuracy"] == {"3": 0.5, "20": 1.0}
    assert row["secret_leak_rate"] == 1.0 and row["public_accuracy"] == 0.5
    assert row["seconds_per_answer"] == 0.5 and row["n_questions"] == 6
    json.dumps(row)


# --------------------------------------------------------------------------- layout and rows
CHATML_LIKE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
               "{% if add_generation_prompt %}<s>assistant\n{% endif %}")  # BOS opens every turn (SmolLM2)


@pytest.mark.parametrize("template", ["demo", "chatml_like", "chatml_like_adding_bos"])
def test_every_row_sees_the_same_tokens_as_full(demo_model, template):
    """DP rows send the user turn; the DP renderer's prepend (context ids + request ids, a
    leading BOS dropped only if the tokenizer adds one) must rebuild exactly the ``full`` prompt;
    ``none`` is the user turn."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from vllm_dp_plugin.serving.context import PrivateContext, added_bos, tokenize_context

    tok = AutoTokenizer.from_pretrained(demo_model)
    if template.startswith("chatml_like"):
        tok.chat_template = CHATML_LIKE
    assert added_bos(tok) is None  # the demo tokenizer names <s> but never adds it (as SmolLM2)
    if template.endswith("adding_bos"):  # a tokenizer that starts every text with BOS (Llama)
        tok._tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", tok.bos_token_id)])
        assert added_bos(tok) == tok.bos_token_id
    layout = ChatLayout(tok)
    s = make_scenarios(1, seed=3)[0]
    q = s["questions"][0]["q"]
    ctx_text = layout.context_text(s["documents"])
    ctx = tokenize_context(ctx_text, tok)
    assert ctx == layout.context_ids(s["documents"]) and ctx.count(tok.bos_token_id) == 1
    assert s["documents"][0] in ctx_text
    full = layout.full_ids(s["documents"], q)
    rendered = tok.apply_chat_template([{"role": "system", "content": "\n".join(s["documents"])},
                                        {"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
    assert tok.decode(full) == rendered  # the chat template's own rendering, BOS once
    context = SimpleNamespace(token_ids=tuple(ctx), bos_token_id=added_bos(tok))  # the renderer's rule:
    served = PrivateContext.prepend(context, layout.dp_ids(s["documents"], q))
    assert served == full
    none = layout.none_ids(s["documents"], q)
    if added_bos(tok) is None:  # the user turn as the template renders it
        assert none == full[len(full) - len(none):]
    else:  # the user turn after the BOS the tokenizer adds
        assert none[0] == tok.bos_token_id and none[1:] == full[len(full) - len(none) + 1:]
    dp = dp_request(layout, s, s["questions"][0])
    assert dp.extra == {"vllm_xargs": {"dp_context": s["id"]}} and dp.expected_prompt_tokens == len(full)


def test_row_registry_jobs_and_servers(tmp_path, monkeypatch):
    assert jobs_of(["none", "full", "dp_state"], [8.0, 1e7]) == [
        ("none", None), ("full", None), ("dp_state", 8.0), ("dp_state", 1e7)]
    with pytest.raises(SystemExit, match="unknown row"):
        jobs_of(["nope"], [8.0])
    b = Bench("m", make_scenarios(2, seed=0), tmp_path, tmp_path / "cache")
    monkeypatch.setattr(Bench, "engine_flags", lambda self: ["--engine"])
    both = b.scenarios
    assert ROWS["none"].server(b, None, both) == ROWS["full"].server(b, None, both)  # one stock server
    assert dict(ROWS["none"].server(b, None, both).env)["VLLM_PLUGINS"] == ""
    monkeypatch.setattr(Bench, "calibration", lambda self: tmp_path / "cal.json")
    monkeypatch.setattr(Bench, "context_files",
                        lambda self, scenarios: {s["id"]: str(tmp_path / f"{s['id']}.txt") for s in scenarios})
    for eps, composition in ((8.0, "pld"), (1e7, "basic")):
        server = ROWS["dp_tree"].server(b, eps, both)
        assert server.dp and "--dp-config" in server.cmd
        cfg = json.loads((tmp_path / f"dp-tree-eps{eps:g}-degree=1-s000.json").read_text())["dp_privacy"]
        att = cfg["attention"]
        assert att["mode"] == "tree" and att["epsilon"] == eps and att["composition"] == composition
        assert list(att["contexts"]) == ["s000", "s001"] and att["calibration"] == str(tmp_path / "cal.json")
        assert cfg["key_file"].startswith(str(tmp_path)) and cfg["ledger"].startswith(str(tmp_path))


def test_rows_of_one_mode_get_their_own_config_and_ledger_and_document_rows_their_collections(tmp_path, monkeypatch):
    b = Bench("m", make_scenarios(2, seed=0), tmp_path, tmp_path / "cache")
    monkeypatch.setattr(Bench, "engine_flags", lambda self: ["--engine"])
    monkeypatch.setattr(Bench, "calibration", lambda self: tmp_path / "cal.json")
    monkeypatch.setattr(Bench, "context_files",
                        lambda self, scenarios: {s["id"]: str(tmp_path / f"{s['id']}.txt") for s in scenarios})
    configs = {}
    for row in ("dp_state", "dp_state_head", "dp_state_bare", "dp_state_doc"):
        server = ROWS[row].server(b, 8.0, b.scenarios)
        configs[row] = json.loads(Path(server.cmd[server.cmd.index("--dp-config") + 1]).read_text())["dp_privacy"]
    assert len({c["ledger"] for c in configs.values()}) == 4
    assert configs["dp_state_bare"]["attention"]["public_head"] == 0 and configs["dp_state_head"]["attention"]["gate"] is False
    doc = configs["dp_state_doc"]["attention"]
    assert doc["unit"] == "document" and all(p.endswith(".jsonl") for p in doc["contexts"].values())


def test_servers_take_the_models_length_and_a_row_that_cannot_fit_is_recorded_not_run(demo_model, tmp_path,
                                                                                       monkeypatch):
    from vllm_dp_plugin.serving.memory import kv_cache_bytes

    scenarios = make_scenarios(2, seed=0)
    b = Bench(str(demo_model), scenarios, tmp_path, tmp_path / "cache", max_tokens=8, concurrency=3)
    assert b.max_model_len == 8192  # the demo model's own maximum (max_position_embeddings)
    flags = b.engine_flags()
    longest = max(len(b.layout().full_ids(s["documents"], q["q"])) for s in scenarios for q in s["questions"])
    assert flags[flags.index("--max-model-len") + 1] == "8192" and "--gpu-memory-utilization" not in flags
    assert int(flags[flags.index("--kv-cache-memory-bytes") + 1]) == kv_cache_bytes(
        str(demo_model), 8192, 3, tokens=longest + 8)
    assert ROWS["none"].server(b, None, scenarios) == ROWS["full"].server(b, None, scenarios)
    assert b.misfit(ROWS["full"], scenarios) is None
    huge = [{**scenarios[0], "documents": [*scenarios[0]["documents"], "word " * 9000]}]
    b = Bench(str(demo_model), huge, tmp_path, tmp_path / "cache", max_tokens=8)
    assert b.misfit(ROWS["none"], huge) is None  # the user turn alone
    assert b.misfit(ROWS["full"], huge).startswith("does not fit: a request needs ")
    monkeypatch.setattr(running, "RunningServer", None)  # no server may start
    results, _, _ = run(b, ["full"], [], log=lambda *_: None)
    assert results == [unfit("full", None, b.misfit(ROWS["full"], huge))]
    lines = markdown({"rows": results, "question_counts": {"shared": 1, "secret": 1, "public": 1},
                            "device": "cpu", "date": "d", "command": "c", "model": "m", "scenarios": "s",
                            "n_scenarios": 1, "max_tokens": 8, "concurrency": 1}).splitlines()
    assert any(line.startswith("| full |  | does not fit: ") for line in lines)
    plot({"rows": results, "model": "m", "device": "cpu", "question_counts_by_support": {}},
               tmp_path / "p.png")


def test_rows_split_scenarios_over_servers():
    scenarios = make_scenarios(7, seed=0)
    tree, state = ROWS["dp_tree"], ROWS["dp_state"]
    parts = server_parts(tree, scenarios)
    assert [len(p) for p in parts] == [2, 2, 2, 1] and [s for p in parts for s in p] == scenarios
    assert server_parts(state, scenarios) == [scenarios]


def test_append_keeps_rows_not_measured_again(tmp_path):
    scenarios = "s.jsonl"
    row = {"row": "none", "eps": None}
    old = {"model": "m", "scenarios": scenarios, "max_tokens": 32, "command": "first", "earlier_commands": [],
           "rows": [row, {"row": "dp_state", "eps": 8.0}], "budgets": [{"row": "dp_state", "eps": 8.0}],
           "sample_answers": [{"row": "none", "eps": None, "text": "x"}]}
    path = tmp_path / "r.json"
    assert kept_rows(None, "m", scenarios, 32, [])["rows"] == []
    assert kept_rows(path, "m", scenarios, 32, [])["rows"] == []  # nothing yet
    path.write_text(json.dumps(old))
    kept = kept_rows(path, "m", scenarios, 32, [("dp_state", 8.0), ("dp_tree", 8.0)])
    assert kept == {"rows": [row], "budgets": [], "sample_answers": old["sample_answers"], "commands": ["first"]}
    with pytest.raises(SystemExit, match="max_tokens"):
        kept_rows(path, "m", scenarios, 8, [])


# --------------------------------------------------------------------------- end to end
@pytest.mark.vllm
def test_quick_run_none_and_full_on_the_demo_model(demo_model, tmp_path):
    out = tmp_path / "results"
    rc = main(["bench", "context", "--quick", "--model", str(demo_model), "--rows", "none,full", "--out", str(out)])
    assert rc == 0
    (result,) = out.glob("context-*.json")
    data = json.loads(result.read_text())
    assert {"model", "device", "date", "scenarios", "rows"} <= set(data)
    assert [(r["row"], r["eps"]) for r in data["rows"]] == [("none", None), ("full", None)]
    n = sum(len(s["questions"]) for s in load_scenarios(DEFAULT_SCENARIOS)[:2])
    for row in data["rows"]:
        assert tuple(row) == ROW_KEYS
        assert row["n_questions"] == n and row["seconds_per_answer"] > 0
        assert set(row["shared_accuracy"]) == {str(s) for s in SUPPORTS}
        assert all(0 <= v <= 1 for v in [*row["shared_accuracy"].values(), row["secret_leak_rate"],
                                          row["public_accuracy"]])
    assert result.with_suffix(".md").exists() and result.with_suffix(".png").exists()
    assert "| none |" in result.with_suffix(".md").read_text()


def test_markdown_fills_every_field():
    row = {"row": "none", "eps": None, "shared_accuracy": {"1": 0.0, "3": 0.5}, "secret_leak_rate": 0.0,
           "public_accuracy": 1.0, "seconds_per_answer": 0.4, "n_questions": 7}
    data = {"device": "cpu-2core", "date": "2026-11-26", "command": "vllm-dp bench context", "model": "m",
            "scenarios": "s.jsonl", "n_scenarios": 1, "question_counts": {"shared": 2, "secret": 1, "public": 4},
            "max_tokens": 32, "concurrency": 8, "rows": [row], "budgets": []}
    text = markdown(data)
    assert "{" not in text and "Greedy, 32 tokens" in text and "| none |  | 0.00 | 0.50 | 0.00 | 1.00 |" in text


def test_the_answer_row_serves_mechanism_answer_and_its_speed_table_compares_with_full(tmp_path, monkeypatch):
    from vllm_dp_plugin.config import DPPrivacyConfig

    b = Bench("m", make_scenarios(2, seed=0), tmp_path, tmp_path / "cache")
    monkeypatch.setattr(Bench, "engine_flags", lambda self: ["--engine"])
    server = ROWS["aggregate_answer"].server(b, 4.0, b.scenarios)
    config = server.cmd[server.cmd.index("--dp-config") + 1]
    section = json.loads(Path(config).read_text())
    assert DPPrivacyConfig.from_dict(section["dp_privacy"]).aggregate.mechanism == "answer"
    assert len(make_scenario(random.Random(7), 0, extra_docs=180)["documents"]) == 200
    rows = [{"documents": 21, "row": "full", "eps": None, "s_per_answer": 1.0, "correct": 5, "questions": 7},
            {"documents": 21, "row": "aggregate_answer", "eps": 4.0, "s_per_answer": 2.5, "correct": 4,
             "questions": 7},
            {"documents": 200, "row": "full", "eps": None, "s_per_answer": None, "note": "does not fit"}]
    text = answer_speed_markdown({"model": "m", "device": "cpu", "date": "d", "command": "c", "eps": 4.0,
                                        "rows": rows})
    assert "| 21 | aggregate_answer | 2.50 | 2.5 | 4 of 7 |" in text and "| 200 | full | does not fit |" in text


def test_the_sweep_never_asks_a_prompt_twice_and_its_table_gives_the_ratio_to_full():
    from benchmarks.context_speed import (
        SWEEP_DOCUMENTS,
        sweep_jobs,
        sweep_markdown,
        sweep_scenarios,
    )

    scenarios = sweep_scenarios()
    assert all(len(s["documents"]) == SWEEP_DOCUMENTS for s in scenarios)
    jobs = sweep_jobs(scenarios, (1, 4, 16), 3)
    asked = [(s["id"], q["q"]) for batch in jobs.values() for s, q in batch]
    assert len(asked) == len(set(asked)) == 3 + 3 * (4 + 4 + 16)  # a repeat would be a whole-prompt cache hit
    assert len({s["id"] for s, _ in jobs[(4, 0)]}) == 3  # round-robin over the collections
    rows = [{"row": "full", "in_flight": 16, "answers_per_s": 2.0, "correct": 30, "asked": 48,
             "answers_per_s_each": [2.0, 1.0, 3.0]},
            {"row": "aggregate_answer", "in_flight": 16, "answers_per_s": 0.5, "correct": 20, "asked": 48,
             "answers_per_s_each": [0.5, 0.5, 0.6]}]
    text = sweep_markdown({"model": "m", "device": "cpu", "date": "d", "command": "c", "eps": 4.0, "repeats": 3,
                           "rows": rows})
    assert "| 16 | 2.000 | 0.500 | 0.25 | 30 of 48, 20 of 48 | 2.000, 1.000, 3.000; 0.500, 0.500, 0.600 |" in text
