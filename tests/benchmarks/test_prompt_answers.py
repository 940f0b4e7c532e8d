"""`vllm-dp bench prompt-answers`: the pure parts on the demo model (fast: no engine) and one
end-to-end run on SmolLM2-135M-Instruct (marked ``vllm``).

* the private mask is exactly the question's tokens, found as the server's renderer finds them;
* the reference row reproduces the un-privatized prompt ids; a token row changes only the
  question's tokens, reproducibly (seeded per question), and its receipt composes over them;
* the metric-DP rows are sent the metric epsilon whose converted guarantee is the grid eps;
* the summary, markdown, JSON and plot of a fake result, failed rows shown as n/a, a saved JSON
  rendered again, ``--append``.
"""

import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from vllm_dp_plugin.benchmarks.lib.scenarios import DEFAULT_MODEL
from vllm_dp_plugin.benchmarks.prompt_answers import build_parser, settings_from_args
from vllm_dp_plugin.benchmarks.prompt_answers.experiment import (
    LLM_ARGS,
    appended,
    failed,
    receipt_total,
    summarize,
)
from vllm_dp_plugin.benchmarks.prompt_answers.privatizers import (
    BASELINES,
    METRIC_DP,
    NO_QUESTION,
    PRIVATIZERS,
    REFERENCE,
    Bench,
    Privatized,
    service_epsilon,
)
from vllm_dp_plugin.benchmarks.prompt_answers.questions import (
    Question,
    build_questions,
    chat_messages,
)
from vllm_dp_plugin.benchmarks.prompt_answers.report import write_results
from vllm_dp_plugin.benchmarks.prompt_answers.settings import Settings
from vllm_dp_plugin.cli import BENCH_SUITES
from vllm_dp_plugin.cli import main as cli_main
from vllm_dp_plugin.prompt.segments import Segment, splice

DATE = "2026-11-27"
SMOLLM = Path(DEFAULT_MODEL)
SCENARIO = {
    "id": "t0",
    "documents": ["Memo: Zorbel Inc. is based in Quantor.", "Note: Zorbel Inc. has 12 staff."],
    "questions": [
        {"q": "Where is Zorbel Inc. based?", "answers": ["Quantor"], "kind": "shared", "support": 1},
        {"q": "How many staff does Zorbel Inc. have?", "answers": ["12"], "kind": "secret", "support": 1},
        {"q": "What is the capital of France?", "answers": ["Paris"], "kind": "public", "support": 0},
    ],
}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from transformers import AutoTokenizer

    from vllm_dp_plugin.demo import make_demo_llama

    path = make_demo_llama(tmp_path_factory.mktemp("answers") / "llama")
    return str(path), AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def demo_bench(demo):
    path, tokenizer = demo
    settings = Settings(model=path, progress=False)
    return Bench(settings, tokenizer, log=lambda _: None)


def tokenizers(demo):
    out = [demo[1]]
    if (SMOLLM / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        out.append(AutoTokenizer.from_pretrained(str(SMOLLM)))
    return out


# --------------------------------------------------------------------------- questions and mask
def test_the_private_mask_is_exactly_the_question_tokens(demo):
    for tokenizer in tokenizers(demo):
        questions = build_questions(tokenizer, [SCENARIO])
        assert [q.kind for q in questions] == ["shared", "secret", "public"]
        for q, spec in zip(questions, SCENARIO["questions"], strict=True):
            ids, mask = q.prompt_ids(), splice(q.segments)[1]
            assert len(ids) == len(mask)
            private = [t for t, m in zip(ids, mask, strict=True) if m]
            assert private == list(q.user_ids) == tokenizer.encode(spec["q"], add_special_tokens=False)
            first = mask.index(True)
            assert all(mask[first : first + len(private)]) and sum(mask) == len(private)  # one contiguous run
            rendered = tokenizer.apply_chat_template(
                chat_messages(q.kind, SCENARIO["documents"], spec["q"]), tokenize=False,
                add_generation_prompt=True)
            assert tokenizer.decode(ids) == rendered  # the whole chat, template pieces included
            public_text = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
            assert spec["q"] not in public_text
            assert ("Quantor" in public_text) == (q.kind != "public")  # documents only with shared/secret


def test_smollm_segments_tokenise_like_the_whole_chat():
    if not (SMOLLM / "tokenizer.json").exists():
        pytest.skip("no .models/smollm2-135m-instruct")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM))
    for q in build_questions(tokenizer, [SCENARIO]):
        messages = chat_messages(q.kind, SCENARIO["documents"], q.text)
        whole = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        whole = whole["input_ids"] if isinstance(whole, dict) or hasattr(whole, "keys") else whole
        assert q.prompt_ids() == list(whole)


def test_prompt_ids_splice_a_user_text_of_any_length():
    q = Question("s/0", "public", "hi", ("x",), (Segment((1, 2), False), Segment((7, 8, 9), True),
                                                      Segment((3,), False)), 1)
    assert q.prompt_ids() == [1, 2, 7, 8, 9, 3]
    assert q.prompt_ids([5]) == [1, 2, 5, 3]
    assert q.prompt_ids([]) == [1, 2, 3]
    assert splice(q.segments)[1] == [False, False, True, True, True, False]


# --------------------------------------------------------------------------- privatizers
def test_the_registry_has_the_reference_and_every_mechanism():
    from vllm_dp_plugin.prompt import MECHANISMS

    assert set(PRIVATIZERS) == {*BASELINES, *MECHANISMS, "paraphrase"}


def test_the_reference_row_reproduces_the_unprivatized_ids(demo, demo_bench):
    questions = build_questions(demo[1], [SCENARIO])
    done = PRIVATIZERS[REFERENCE](demo_bench, None, questions)
    assert [q.prompt_ids(p.ids) for q, p in zip(questions, done, strict=True)] == [q.prompt_ids() for q in questions]
    assert all(p.receipt is None for p in done)
    row = summarize(REFERENCE, None, questions, done, ["Quantor", "no idea", "Paris!"])
    assert row["unchanged"] == 1.0 and row["questions_unchanged"] == 3
    assert (row["shared_accuracy"], row["secret_accuracy"], row["public_accuracy"]) == (1.0, 0.0, 1.0)
    assert "total_epsilon" not in row
    empty = PRIVATIZERS[NO_QUESTION](demo_bench, None, questions)
    assert [q.prompt_ids(p.ids) for q, p in zip(questions, empty, strict=True)] == [
        [t for t, m in zip(q.prompt_ids(), splice(q.segments)[1], strict=True) if not m] for q in questions]


def test_a_token_row_changes_only_the_question_and_is_seeded(demo, demo_bench):
    questions = build_questions(demo[1], [SCENARIO])
    laplace = PRIVATIZERS["laplace"]
    done = laplace(demo_bench, 1.0, questions)
    again = laplace(demo_bench, 1.0, questions)
    assert [p.ids for p in done] == [p.ids for p in again]  # noise seeded per (mechanism, eps, question)
    assert [p.ids for p in laplace(demo_bench, 2.0, questions)] != [p.ids for p in done]
    for q, p in zip(questions, done, strict=True):
        assert len(p.ids) == len(q.user_ids)
        out, mask = q.prompt_ids(p.ids), splice(q.segments)[1]
        assert [t for t, m in zip(out, mask, strict=True) if not m] == [
            t for t, m in zip(q.prompt_ids(), mask, strict=True) if not m]
        assert p.receipt["tokens_privatized"] == len(q.user_ids)
        eps, delta = receipt_total(p.receipt)
        assert eps == pytest.approx(len(q.user_ids) * 1.0) and delta == 0.0  # basic composition, pure DP
    assert sum(p.ids != q.user_ids for q, p in zip(questions, done, strict=True)) >= 1  # eps = 1 changes words
    huge = laplace(demo_bench, 1e7, questions)
    assert [p.ids for p in huge] == [q.user_ids for q in questions]


def test_metric_rows_guarantee_the_grid_eps(demo, demo_bench):
    questions = build_questions(demo[1], [SCENARIO])[:1]
    for name in METRIC_DP:
        eps_m = service_epsilon(demo_bench, name, 20.0)
        diameter = demo_bench.diameter(name)
        assert eps_m == pytest.approx(20.0 / diameter)
        done = PRIVATIZERS[name](demo_bench, 20.0, questions)[0]
        assert done.receipt["epsilon_token"] == pytest.approx(20.0, rel=1e-12)
        assert done.info["service_epsilon"] == eps_m
    key = {"mahalanobis": "mahalanobis_diameter", "cmp": "sensitivity_l2"}
    assert set(key.values()) <= set(demo_bench.table_info)
    assert service_epsilon(demo_bench, "laplace", 20.0) == 20.0


def test_a_failing_calibration_is_a_row_not_a_crash(demo, demo_bench):
    questions = build_questions(demo[1], [SCENARIO])[:1]
    with pytest.raises(ValueError):
        PRIVATIZERS["trlap_repro"](demo_bench, 200.0, questions)  # Thm 3 undefined above ~20.6
    row = failed("trlap_repro", 200.0, ValueError("p > 1"))
    assert row["error"] == "ValueError: p > 1"


# --------------------------------------------------------------------------- report
def fake_results(tmp_path) -> dict:
    segs = (Segment((1,), False), Segment((5, 6), True), Segment((2,), False))
    questions = [Question(f"s/{i}", kind, "q", ("yes",), segs, 1)
                 for i, kind in enumerate(["public", "shared", "shared", "secret"])]

    def receipt(eps, n=2, valid=True):
        total = {"epsilon": n * eps if valid else "inf", "delta": 0.0 if valid else 1.0}
        return {"epsilon_token": eps, "delta_token": 0.0, "valid": valid, "statement": "s",
                "tokens_privatized": n, "prompt_total": {"min": total}}

    rows = [summarize(REFERENCE, None, questions, [Privatized((5, 6))] * 4,
                            ["yes", "yes", "no", "no"])]
    for eps in (5.0, 50.0):
        done = [Privatized((5, 7), receipt(eps))] * 4
        rows.append(summarize("laplace", eps, questions, done, ["no", "yes", "no", "no"]))
        done = [Privatized((5, 6), receipt(eps, valid=False), {"effective_dim": 900})] * 4
        rows.append(summarize("trlap_paper", eps, questions, done, ["yes", "yes", "yes", "no"]))
        done = [Privatized((8, 6), receipt(eps), {"service_epsilon": eps / 4})] * 4
        rows.append(summarize("cmp", eps, questions, done, ["yes", "no", "no", "yes"]))
    rows.append(failed("trlap_repro", 5.0, ValueError("undefined")))
    rows.append(failed("trlap_repro", 50.0, ValueError("undefined")))
    settings = Settings(out=tmp_path, date=DATE, command="vllm-dp bench prompt-answers --fake")
    results = {
        "machine": {"device": "cpu", "label": "cpu-2core", "platform": "linux", "python": "3.11",
                    "torch": "2", "cpu": "x", "cpu_count": 2},
        "device": "cpu",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        "data": {"scenarios": 1, "questions": {"public": 1, "shared": 2, "secret": 1},
                 "question_tokens": [2, 2.0, 2], "prompt_tokens": 16},
        "engine": {"llm": LLM_ARGS, "vllm_plugins": "", "vllm": "0"},
        "table": {"describe": "fake", "sensitivity_l2": 4.0},
        "rows": rows,
        "examples": {"reference@-": [{"question": "s/0", "kind": "public", "text": "q|x", "answer": "yes",
                                      "correct": True}],
                     "laplace@5": [{"question": "s/0", "kind": "public", "text": "zz", "answer": "no",
                                    "correct": False}]},
        "timing": {"generate_s": 1.0},
        "runtime_s": 3.0,
    }
    return results


def test_summary_of_a_fake_run(tmp_path):
    results = fake_results(tmp_path)
    ref, lap5, paper5, cmp5 = results["rows"][:4]
    assert (ref["public_accuracy"], ref["shared_accuracy"], ref["secret_accuracy"]) == (1.0, 0.5, 0.0)
    assert ref["shared_n"] == 2 and ref["shared_ci"][0] < 0.5 < ref["shared_ci"][1]
    assert lap5["unchanged"] == 0.5 and lap5["questions_unchanged"] == 0
    assert lap5["total_epsilon"] == 10.0 and lap5["total_delta"] == 0.0
    assert math.isinf(paper5["total_epsilon"]) and paper5["claimed_total_epsilon"] == 10.0
    assert paper5["effective_dim"] == 900 and cmp5["service_epsilon"] == 1.25
    assert ref["correct"] == [1, 1, 0, 0]


def test_markdown_json_and_plot_of_a_fake_run(tmp_path):
    results = fake_results(tmp_path)
    files = write_results(results)
    stem = f"prompt-answers-cpu-{DATE}"
    assert [p.name for p in files] == [f"{stem}.md", f"{stem}.json", f"{stem}.png"]
    assert files[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = files[0].read_text()
    for needle in ("## Answer accuracy, public questions (n = 1)", "Reference (un-privatized question): **1.00**",
                   "## Answer accuracy, shared questions (n = 2)", "## Answer accuracy, secret questions",
                   "| mechanism | eps=5 | eps=50 |", "| laplace | 0.00 | 0.00 |",
                   "| trlap_paper (claimed eps; not DP) | 1.00 | 1.00 |",
                   "| trlap_repro (claimed eps; not DP) | n/a | n/a |",
                   "## Question tokens unchanged", "## What the receipt says was spent",
                   "| laplace | 10 (0) | 100 (0) |", "| no guarantee (claimed 10) | no guarantee (claimed 100) |", "Metric epsilon eps_m",
                   "## Rows that could not run (n/a)", "trlap_repro eps=5: ValueError: undefined",
                   "## Examples", '"q\\|x" -> "yes" (correct)', f"![answer accuracy vs eps]({stem}.png)"):
        assert needle in text, needle
    saved = json.loads(files[1].read_text())
    assert saved["rows"][0]["mechanism"] == "reference" and saved["notes"]
    files[0].unlink()
    write_results(saved)  # a saved result renders the same
    assert files[0].read_text() == text


def test_append_replaces_rows_of_the_same_mechanism_and_eps(tmp_path):
    results = fake_results(tmp_path)
    results["data"]["keys"] = ["s/0", "s/1", "s/2", "s/3"]
    write_results(results)
    new = json.loads(json.dumps(results))
    new["rows"] = [dict(results["rows"][1], shared_accuracy=1.0), {**results["rows"][1], "mechanism": "paraphrase"}]
    merged = appended(new)
    keys = [(r["mechanism"], r["eps"]) for r in merged["rows"]]
    assert len(keys) == len(set(keys)) == len(results["rows"]) + 1
    assert next(r for r in merged["rows"] if (r["mechanism"], r["eps"]) == ("laplace", 5.0))["shared_accuracy"] == 1.0
    new["data"]["keys"] = ["other"]
    with pytest.raises(SystemExit, match="other questions"):
        appended(new)


def test_quick_sizes_yield_to_the_options_given():
    argv = ["--quick", "--limit", "5", "--date", DATE]
    settings = settings_from_args(build_parser().parse_args(argv), argv)
    assert (settings.mechanisms, settings.epsilons, settings.limit) == (("laplace", "trlap_corrected"), (20.0, 200.0), 5)
    assert settings.quick and settings.date == DATE and settings.seed == 0
    assert settings.command == f"vllm-dp bench prompt-answers --quick --limit 5 --date {DATE}"


def test_the_suite_is_routed(capsys):
    assert BENCH_SUITES["prompt-answers"][0] == "prompt_answers"
    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "prompt-answers", "--help"])
    assert exit_.value.code == 0
    assert "--limit" in capsys.readouterr().out


# --------------------------------------------------------------------------- engine (slow)
@pytest.mark.vllm
def test_one_scenario_end_to_end_on_smollm(tmp_path):
    """The reference and no-question rows and laplace at a huge eps (every question token kept) on
    the first scenario: the same answers as the reference; files written; routed through the CLI."""
    if not (SMOLLM / "config.json").exists():
        pytest.skip("no .models/smollm2-135m-instruct")
    cmd = [sys.executable, "-m", "vllm_dp_plugin.cli", "bench", "prompt-answers", "--limit", "1",
           "--mechanisms", "laplace", "--eps", "1e7", "--out", str(tmp_path), "--date", DATE, "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (found,) = tmp_path.glob(f"prompt-answers-*-{DATE}.json")
    results = json.loads(found.read_text())
    ref, empty, lap = results["rows"]
    assert [r["mechanism"] for r in results["rows"]] == ["reference", "no_question", "laplace"]
    assert empty["unchanged"] == 0.0 and "error" not in empty
    assert lap["unchanged"] == 1.0 and lap["correct"] == ref["correct"]
    assert lap["total_epsilon"] == pytest.approx(1e7 * lap["tokens_privatized"])
    assert sum(results["data"]["questions"].values()) == 7 and ref["shared_n"] == 4
    assert found.with_suffix(".png").exists() and found.with_suffix(".md").exists()
