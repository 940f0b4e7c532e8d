"""``vllm-dp bench prompt-answers``' measurement: the engine, every (mechanism, eps) privatized and
answered (``run``), and ``--append``."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.cli import today
from vllm_dp_plugin.benchmarks.lib.environment import default_device, device_label, environment
from vllm_dp_plugin.benchmarks.lib.progress import Progress, logger
from vllm_dp_plugin.benchmarks.lib.report import fmt, read_json, suffixed
from vllm_dp_plugin.benchmarks.lib.scenarios import ensure_model, load_scenarios
from vllm_dp_plugin.benchmarks.prompt_answers.privatizers import PRIVATIZERS, Bench
from vllm_dp_plugin.benchmarks.prompt_answers.questions import MAX_MODEL_LEN, build_questions
from vllm_dp_plugin.benchmarks.prompt_answers.report import BASELINES, stem, write_results
from vllm_dp_plugin.benchmarks.prompt_answers.rows import (
    KINDS,
    example_picks,
    example_texts,
    failed,
    summarize,
)
from vllm_dp_plugin.benchmarks.prompt_answers.settings import Settings
from vllm_dp_plugin.serving.memory import kv_cache_args

EXAMPLE_EPS = (10.0, 50.0, 200.0)
# The engine of every row (the serving benchmarks' settings; its KV cache: llm_args).
LLM_ARGS = {"dtype": "float32", "enforce_eager": True, "max_model_len": MAX_MODEL_LEN, "block_size": 32, "seed": 0}


def llm_args(model: str) -> dict:
    """``LLM_ARGS`` with a KV cache in bytes for ``model`` (serving.memory's default sequences)."""
    return {**LLM_ARGS, **kv_cache_args(model, MAX_MODEL_LEN)}


def start_engine(model: str):
    """The offline engine, in this process's control (CPU vLLM spawns its workers: run under a
    ``__main__`` guard). With the dp_privacy general plugin (``VLLM_PLUGINS`` unless set): without
    a dp_privacy section it changes nothing, and it installs the worker method the paraphrase row's
    fail-closed check calls; the token mechanisms privatize before the engine."""
    os.environ.setdefault("VLLM_PLUGINS", "dp_privacy")
    from vllm_dp_plugin.serving.vllm_compat import install_version_shim

    install_version_shim()
    from vllm import LLM

    return LLM(model=model, **llm_args(model))


def run(settings: Settings, llm=None) -> dict:
    """Run every row and write the result files; ``llm``: an engine already up (else started)."""
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
    bench = Bench(settings, tokenizer, log)
    _ = bench.service  # the table first: a configuration that cannot be built fails before the engine
    t0 = time.perf_counter()
    log(f"starting vLLM on {settings.model} ...")
    bench.llm = llm if llm is not None else start_engine(settings.model)
    bench.timing["engine_s"] = time.perf_counter() - t0

    jobs: list[tuple[str, float | None]] = [(b, None) for b in BASELINES]
    jobs += [(m, e) for m in settings.mechanisms if m not in BASELINES for e in settings.epsilons]
    picks = example_picks(questions)
    rows, examples = [], {}
    bench.timing.update(privatize_s=0.0, generate_s=0.0)
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
            log(f"{name} eps={eps}: {row['error']}")
        else:
            row = summarize(name, eps, questions, done, answers)
            row.update(privatize_s=t1 - t0, generate_s=t2 - t1)
            bench.timing["privatize_s"] += t1 - t0
            bench.timing["generate_s"] += t2 - t1
            if eps is None or eps in EXAMPLE_EPS:
                examples[f"{name}@{'-' if eps is None else f'{eps:g}'}"] = example_texts(
                    tokenizer, questions, done, answers, picks)
            log(describe(row))
        rows.append(row)
        bar.update(1)
    bar.close()

    results = {
        "machine": environment(default_device()),
        "device": device_label(default_device(), short=True),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        "data": {
            "scenarios": len(scenarios),
            "questions": {k: sum(q.kind == k for q in questions) for k in KINDS},
            "question_tokens": [min(len(q.user_ids) for q in questions),
                                sum(len(q.user_ids) for q in questions) / len(questions),
                                max(len(q.user_ids) for q in questions)],
            "prompt_tokens": sum(len(q.prompt_ids()) for q in questions),
            "keys": [q.key for q in questions],
            "kinds": [q.kind for q in questions],
        },
        "engine": {"llm": llm_args(settings.model), "vllm_plugins": os.environ.get("VLLM_PLUGINS"),
                   "vllm": _vllm_version()},
        "table": bench.table_info,
        "rows": rows,
        "examples": examples,
        "timing": bench.timing,
        "runtime_s": time.perf_counter() - start,
    }
    if settings.append:
        results = appended(results, settings)
    write_results(results, settings)
    return results


def appended(results: dict, settings: Settings) -> dict:
    """``results`` merged into the saved results of the same file (same questions required): its
    rows replace the saved rows of the same (mechanism, eps), the others are kept."""
    path = suffixed(stem(settings, results), ".json")
    if not path.exists():
        return results
    saved = read_json(path)
    if saved["data"]["keys"] != results["data"]["keys"]:
        raise SystemExit(f"--append: {path} was run on other questions (scenarios/limit differ)")
    mine = {(r["mechanism"], r["eps"]) for r in results["rows"]}
    results["rows"] = [r for r in saved["rows"] if (r["mechanism"], r["eps"]) not in mine] + results["rows"]
    results["examples"] = {**saved.get("examples", {}), **results["examples"]}
    results["table"] = {**saved.get("table", {}), **results["table"]}
    results["runtime_s"] += saved.get("runtime_s", 0.0)
    results["settings"]["command"] = f"{saved['settings'].get('command', '')}; then {results['settings']['command']}"
    return results


def _vllm_version() -> str:
    try:
        import vllm

        return vllm.__version__
    except Exception:  # noqa: BLE001
        return "unknown"


def describe(row: dict) -> str:
    label = row["mechanism"] + ("" if row["eps"] is None else f" eps={row['eps']:g}")
    if "error" in row:
        return f"{label}: n/a ({row['error']})"
    acc = " ".join(f"{k} {row[f'{k}_accuracy']:.2f}" for k in KINDS if f"{k}_accuracy" in row)
    total = f", receipt total eps {fmt(row['total_epsilon'])}" if "total_epsilon" in row else ""
    return f"{label}: {acc}, tokens unchanged {row['unchanged']:.2f}{total}"
