"""``vllm-dp bench prompt-answers``' measurement: the engine, every (mechanism, eps) privatized and
answered (``run``), its result row (``summarize``: accuracy per question kind with Wilson intervals,
tokens kept, receipts), and ``--append``."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

from vllm_dp_plugin.prompt.mechanisms import REPRODUCTION
from vllm_dp_plugin.serving.memory import kv_cache_args
from vllm_dp_plugin.serving.vllm_compat import install_version_shim

from ..lib.cli import today
from ..lib.environment import default_device, device_label, environment
from ..lib.progress import Progress, logger
from ..lib.report import fmt, read_json, suffixed
from ..lib.scenarios import ensure_model, is_correct, load_scenarios
from .privatizers import BASELINES, PRIVATIZERS, Bench, Privatized
from .questions import KINDS, MAX_MODEL_LEN, Question, build_questions
from .report import stem, write_results
from .settings import Settings

EXAMPLE_EPS = (10.0, 50.0, 200.0)
# The engine of every row (the serving benchmarks' settings), with a KV cache in bytes for the model
# (serving.memory's default sequences).
LLM_ARGS = {"dtype": "float32", "enforce_eager": True, "max_model_len": MAX_MODEL_LEN, "block_size": 32, "seed": 0}


def start_engine(model: str, llm_args: dict):
    """The offline engine (CPU vLLM spawns its workers: run under a ``__main__`` guard), with the
    dp_privacy general plugin (``VLLM_PLUGINS`` unless set): without a dp_privacy section it changes
    nothing, and it installs the worker method the paraphrase row's fail-closed check calls."""
    os.environ.setdefault("VLLM_PLUGINS", "dp_privacy")
    install_version_shim()
    from vllm import LLM

    return LLM(model=model, **llm_args)


def run(settings: Settings) -> dict:
    """Run every row (a privatizer's exception is a row with its error) and write the result files."""
    from transformers import AutoTokenizer

    start = time.perf_counter()
    settings.date = today(settings.date)
    if settings.mechanisms is None:
        settings.mechanisms = tuple(m for m in PRIVATIZERS if m not in BASELINES)
    unknown = set(settings.mechanisms) - set(PRIVATIZERS)
    if unknown:
        raise SystemExit(f"unknown mechanisms {sorted(unknown)}; use {', '.join(PRIVATIZERS)}")
    settings.model = ensure_model(settings.model)
    log = logger(settings.progress, sys.stderr)
    scenarios = load_scenarios(settings.scenarios)[: settings.limit]
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    questions = build_questions(tokenizer, scenarios)
    bench = Bench(settings, tokenizer, log)  # the table first: a configuration that cannot be built fails early
    t0 = time.perf_counter()
    log(f"starting vLLM on {settings.model} ...")
    llm_args = {**LLM_ARGS, **kv_cache_args(settings.model, MAX_MODEL_LEN)}
    bench.llm = start_engine(settings.model, llm_args)
    bench.timing.update(engine_s=time.perf_counter() - t0, privatize_s=0.0, generate_s=0.0)

    rows, texts = [], {}
    jobs = [(b, None) for b in BASELINES]
    jobs += [(m, e) for m in settings.mechanisms if m not in BASELINES for e in settings.epsilons]
    bar = Progress(settings.progress).bar(len(jobs), "bench prompt-answers")
    for name, eps in jobs:
        bar.set_postfix_str(name if eps is None else f"{name} eps={eps:g}")
        try:
            t0 = time.perf_counter()
            done = PRIVATIZERS[name](bench, eps, questions)
            t1 = time.perf_counter()
            answers = bench.generate([q.prompt_ids(p.ids) for q, p in zip(questions, done, strict=True)])
            t2 = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - a calibration that fails is a row (n/a), not a crash
            row = failed(name, eps, exc)
        else:
            row = summarize(name, eps, questions, done, answers)
            row.update(privatize_s=t1 - t0, generate_s=t2 - t1)
            bench.timing["privatize_s"] += t1 - t0
            bench.timing["generate_s"] += t2 - t1
            if eps is None or eps in EXAMPLE_EPS:
                key = f"{name}@{'-' if eps is None else f'{eps:g}'}"
                texts[key] = examples(tokenizer, questions, done, answers)
        log(describe(row))
        rows.append(row)
        bar.update(1)
    bar.close()

    import vllm  # started above

    lengths = [len(q.user_ids) for q in questions]
    results = {
        "machine": environment(default_device()),
        "device": device_label(default_device(), short=True),
        "settings": asdict(settings),
        "data": {"scenarios": len(scenarios), "questions": {k: sum(q.kind == k for q in questions) for k in KINDS},
                 "question_tokens": [min(lengths), sum(lengths) / len(lengths), max(lengths)],
                 "prompt_tokens": sum(len(q.prompt_ids()) for q in questions),
                 "keys": [q.key for q in questions], "kinds": [q.kind for q in questions]},
        "engine": {"llm": llm_args, "vllm_plugins": os.environ.get("VLLM_PLUGINS"), "vllm": vllm.__version__},
        "table": bench.table_info, "rows": rows, "examples": texts, "timing": bench.timing,
        "runtime_s": time.perf_counter() - start,
    }
    if settings.append:
        results = appended(results)
    write_results(results)
    return results


def appended(results: dict) -> dict:
    """``results`` merged into the saved results of the same file (same questions required): its
    rows replace the saved rows of the same (mechanism, eps), the others are kept."""
    path = suffixed(stem(results), ".json")
    if not path.exists():
        return results
    saved = read_json(path)
    if saved["data"]["keys"] != results["data"]["keys"]:
        raise SystemExit(f"--append: {path} was run on other questions (scenarios/limit differ)")
    mine = {(r["mechanism"], r["eps"]) for r in results["rows"]}
    results["rows"] = [r for r in saved["rows"] if (r["mechanism"], r["eps"]) not in mine] + results["rows"]
    for key in ("examples", "table"):
        results[key] = {**saved[key], **results[key]}
    results["runtime_s"] += saved["runtime_s"]
    results["settings"]["command"] = f"{saved['settings']['command']}; then {results['settings']['command']}"
    return results


def receipt_total(receipt: dict) -> tuple[float, float]:
    """(epsilon, delta) of ``receipt.prompt.total`` (the composition over the question's tokens);
    inf where the receipt states no guarantee."""
    total = receipt["prompt_total"]["min"]
    return float(total["epsilon"]), float(total["delta"])


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of ``k`` successes in ``n >= 1`` trials (95% for z = 1.96)."""
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def summarize(mechanism: str, eps: float | None, questions: Sequence[Question], done: Sequence[Privatized],
              answers: Sequence[str]) -> dict:
    """One row: accuracy per kind (with a 95% Wilson CI), the question tokens kept at their position,
    the receipts (the first one's per-token statement, the mean total over questions)."""
    correct = [is_correct(a, q.answers) for q, a in zip(questions, answers, strict=True)]
    row: dict = {"mechanism": mechanism, "eps": eps, "questions": len(questions)}
    for kind in KINDS:
        hits = [c for q, c in zip(questions, correct, strict=True) if q.kind == kind]
        if hits:
            row.update({f"{kind}_accuracy": sum(hits) / len(hits), f"{kind}_ci": wilson(sum(hits), len(hits)),
                        f"{kind}_n": len(hits)})
    pairs = list(zip(questions, done, strict=True))
    tokens = sum(len(q.user_ids) for q in questions)
    kept = sum(a == b for q, p in pairs for a, b in zip(q.user_ids, p.ids, strict=False))
    row.update(tokens=tokens, kept=kept, unchanged=kept / tokens if tokens else math.nan,
               questions_unchanged=sum(tuple(p.ids) == q.user_ids for q, p in pairs),
               correct=[int(c) for c in correct])
    receipts = [p.receipt for p in done if p.receipt is not None]
    if receipts:
        totals, n = [receipt_total(r) for r in receipts], len(receipts)
        row.update({k: receipts[0][k] for k in ("epsilon_token", "delta_token", "valid", "statement")},
                   total_epsilon=sum(e for e, _ in totals) / n, total_delta=sum(d for _, d in totals) / n,
                   tokens_privatized=sum(float(r["tokens_privatized"]) for r in receipts) / n, **done[0].info)
    if mechanism in REPRODUCTION and eps is not None:
        row["claimed_total_epsilon"] = eps * row["tokens"] / len(questions)
    return row


def failed(mechanism: str, eps: float | None, exc: BaseException) -> dict:
    """The row of a privatizer that raised (shown as n/a)."""
    return {"mechanism": mechanism, "eps": eps, "error": f"{type(exc).__name__}: {exc}"}


def describe(row: dict) -> str:
    """One line of a row: accuracy per kind, tokens unchanged, the receipt's total eps."""
    label = row["mechanism"] + ("" if row["eps"] is None else f" eps={row['eps']:g}")
    if "error" in row:
        return f"{label}: n/a ({row['error']})"
    acc = " ".join(f"{k} {row[f'{k}_accuracy']:.2f}" for k in KINDS if f"{k}_accuracy" in row)
    total = f", receipt total eps {fmt(row['total_epsilon'])}" if "total_epsilon" in row else ""
    return f"{label}: {acc}, tokens unchanged {row['unchanged']:.2f}{total}"


def examples(tokenizer, questions: Sequence[Question], done: Sequence[Privatized],
             answers: Sequence[str]) -> list[dict]:
    """The first question of each kind: its privatized text, the answer and whether it is correct."""
    kinds = [q.kind for q in questions]
    return [{"question": questions[i].key, "kind": questions[i].kind, "text": tokenizer.decode(list(done[i].ids)),
             "answer": answers[i], "correct": is_correct(answers[i], questions[i].answers)}
            for i in (kinds.index(k) for k in KINDS if k in kinds)]
