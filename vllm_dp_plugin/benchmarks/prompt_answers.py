"""``vllm-dp bench prompt --answers`` (= ``vllm-dp bench prompt-answers``): answer accuracy of a real model on privatized questions.

``vllm-dp bench prompt`` measures prompt privatization as token preservation on MiniLM's
vocabulary; this suite asks what a real chat model answers when the user's question has been
privatized by the plugin's own service, exactly as the server runs it:

* model: SmolLM2-135M-Instruct (``.models/smollm2-135m-instruct``), its own chat template and its
  own public input-embedding table (49,152 x 576) as the privatization table;
* questions: the scenarios of ``benchmarks/data/context-scenarios.jsonl`` (``lib.scenarios``):
  ``public`` questions are asked with no system prompt (the template's default), ``shared`` and
  ``secret`` questions with the scenario's documents as a plain system prompt, one per line. The
  documents are NOT private here: only the user's question is;
* private tokens: the question's own tokens, located as the server's renderer does
  (``prompt.segments.mark_user_texts`` + ``segment_chat``: the template rendered with the text and
  with a sentinel, every piece tokenised on its own); the template and system prompt pass through;
* privatization: ``serving.prompt_table.build_prompt_privacy(model, tokenizer,
  PromptPrivacyConfig(...), None)`` and ``service.privatize(segments, service.options({"dp_mechanism":
  m, "dp_epsilon": eps}), seed=...)``, the noise seeded per (mechanism, eps, question);
* generation: offline ``vllm.LLM`` (float32, eager, greedy, ``scenarios.ANSWER_TOKENS`` tokens),
  the token ids of every prompt of a row in one ``generate`` call; an answer is correct when one
  of the question's answers occurs in it (``scenarios.is_correct``).

Rows: the un-privatized question (``reference``), the question removed (``no_question``: an empty
user turn, the eps -> 0 end: what the documents alone give) and every mechanism of ``prompt.MECHANISMS`` at
each per-token eps of the grid. The metric-DP mechanisms (``mahalanobis``, ``cmp``) are run at
metric epsilon ``eps_m = eps / Delta`` (Delta the table's diameter in the mechanism's metric) so
that the per-token eps they guarantee equals the grid value; ``trlap_paper`` / ``trlap_repro`` are
reproductions whose claimed delta is false (not DP): they are labelled and plotted at the claimed
eps. A calibration that fails at some eps (e.g. ``trlap_corrected`` overflowing) is a row with its
error, shown as n/a.

Each row's privatizer is an entry of ``PRIVATIZERS``: ``fn(bench, eps, questions) -> [Privatized]``
(the question's privatized user-text ids, any length, and the receipt as ``PromptReceipt.to_json()``),
with the loaded engine at ``bench.llm`` (``bench.outputs(prompts, SamplingParams)``,
``bench.generate``), the tokenizer and the model's ``PromptPrivacy`` service. A contextual
mechanism that rewrites the question with the model itself is one more entry, e.g.::

    def paraphrase(bench, eps, questions):
        rewrite = [rewrite_prompt_ids(bench.tokenizer, q.text) for q in questions]  # public instruction
        outs = bench.outputs(rewrite, SamplingParams(max_tokens=CAP, logits_processors=...))
        return [Privatized(tuple(o.outputs[0].token_ids), receipt_json(eps, len(o.outputs[0].token_ids)))
                for o in outs]

    PRIVATIZERS["paraphrase"] = paraphrase

and runs by default (every registered privatizer does); the harness splices the new user text
between the template pieces, scores the answers and plots the row at its per-token eps and at
its receipt's total eps. "Tokens unchanged" is positional, so read it loosely for a rewrite.

Writes ``prompt-answers-<device>-<date>.{md,json,png}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.cli import (
    DEFAULT_OUT,
    add_date_arg,
    add_out_arg,
    add_quick_arg,
    command_line,
    floats,
    names,
    parse,
    today,
)
from vllm_dp_plugin.benchmarks.lib.environment import default_device, device_label, environment
from vllm_dp_plugin.benchmarks.lib.progress import Progress, logger
from vllm_dp_plugin.benchmarks.lib.report import (
    fmt,
    pyplot,
    read_json,
    save_figure,
    suffixed,
    write_json,
    write_text,
)
from vllm_dp_plugin.benchmarks.lib.report import table as md_table
from vllm_dp_plugin.benchmarks.lib.scenarios import (
    ANSWER_TOKENS,
    DEFAULT_MODEL,
    DEFAULT_SCENARIOS,
    ensure_model,
    is_correct,
    load_scenarios,
)
from vllm_dp_plugin.privacy.trlaplace import paper_effective_dim
from vllm_dp_plugin.prompt.mechanisms import MECHANISMS
from vllm_dp_plugin.prompt.segments import Segment, mark_user_texts, segment_chat
from vllm_dp_plugin.serving.memory import kv_cache_args

SUITE = "prompt-answers"
REFERENCE = "reference"
NO_QUESTION = "no_question"  # the user text removed: the eps -> 0 end (what the prompt alone gives)
BASELINES = (REFERENCE, NO_QUESTION)  # rows without eps, run once each
KINDS = ("public", "shared", "secret")  # report order
METRIC_DP = ("mahalanobis", "cmp")
REPRODUCTION = ("trlap_paper", "trlap_repro")
NEEDS_DIAMETER = ("gaussian_analytic", "expmech", "cmp")  # the table's exact l2 diameter
DEFAULT_EPS = (5.0, 10.0, 20.0, 50.0, 100.0, 200.0)
MAHALANOBIS_LAMBDA = 0.5  # what the service's token_mechanism uses (its default)
EXAMPLE_EPS = (10.0, 50.0, 200.0)
MAX_MODEL_LEN = 2048
# The engine of every row (the serving benchmarks' settings; its KV cache: llm_args).
LLM_ARGS = {"dtype": "float32", "enforce_eager": True, "max_model_len": MAX_MODEL_LEN, "block_size": 32, "seed": 0}


def llm_args(model: str) -> dict:
    """``LLM_ARGS`` with a KV cache in bytes for ``model`` (serving.memory's default sequences)."""
    return {**LLM_ARGS, **kv_cache_args(model, MAX_MODEL_LEN)}


# --------------------------------------------------------------------------- settings
@dataclass
class Settings:
    model: str = DEFAULT_MODEL
    scenarios: str = str(DEFAULT_SCENARIOS)
    out: Path = DEFAULT_OUT
    mechanisms: tuple[str, ...] | None = None  # None: every registered privatizer (``PRIVATIZERS``)
    epsilons: tuple[float, ...] = DEFAULT_EPS
    limit: int | None = None  # first N scenarios (None: all)
    seed: int = 0
    delta: float = 1e-6
    max_tokens: int = ANSWER_TOKENS
    quick: bool = False
    progress: bool = True
    append: bool = False
    date: str = ""
    command: str = ""

    @staticmethod
    def quick_defaults() -> dict:
        """Smoke-test sizes: no mechanism that needs a 49k^2 diameter, 3 scenarios."""
        return {"mechanisms": ("laplace", "trlap_corrected"), "epsilons": (20.0, 200.0), "limit": 3}


# --------------------------------------------------------------------------- questions
@dataclass(frozen=True)
class Question:
    """One question as the model sees it: ``segments`` (``segment_chat``: template pieces and the
    one private segment, the user's text, at ``private``)."""

    scenario: str
    index: int  # position within the scenario
    kind: str
    text: str
    answers: tuple[str, ...]
    segments: tuple[Segment, ...]
    private: int  # index of the user text's segment

    @property
    def key(self) -> str:
        return f"{self.scenario}/{self.index}"

    @property
    def user_ids(self) -> tuple[int, ...]:
        return self.segments[self.private].ids

    def prompt_ids(self, user_ids: Sequence[int] | None = None) -> list[int]:
        """The prompt's ids with the user text's ids replaced by ``user_ids`` (any length)."""
        out: list[int] = []
        for i, segment in enumerate(self.segments):
            out.extend(user_ids if i == self.private and user_ids is not None else segment.ids)
        return out

    def private_mask(self) -> list[bool]:
        return [s.private for s in self.segments for _ in s.ids]


def chat_messages(kind: str, documents: Sequence[str], question: str) -> list[dict]:
    """No system prompt for public questions; the documents as a plain system prompt (one per line)
    otherwise."""
    user = {"role": "user", "content": question}
    if kind == "public":
        return [user]
    return [{"role": "system", "content": "\n".join(documents)}, user]


def question_segments(tokenizer, messages: Sequence[dict], max_tokens: int | None = MAX_MODEL_LEN) -> list[Segment]:
    """The server renderer's segmentation of a chat (``serving.renderer._privatize_chat``): the
    template rendered with the user text and with a sentinel in its place, every piece tokenised
    on its own without added special tokens."""
    marked = mark_user_texts(messages)

    def render(msgs) -> str:
        return tokenizer.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=True)

    return segment_chat(marked, render(messages), render(marked.messages),
                        lambda text: tokenizer.encode(text, add_special_tokens=False), max_tokens=max_tokens)


def build_questions(tokenizer, scenarios: Sequence[dict]) -> list[Question]:
    out = []
    for s in scenarios:
        for i, q in enumerate(s["questions"]):
            segments = question_segments(tokenizer, chat_messages(q["kind"], s["documents"], q["q"]))
            private = [j for j, seg in enumerate(segments) if seg.private]
            if len(private) != 1:
                raise ValueError(f"{s['id']}/{i}: expected one private segment, got {len(private)}")
            out.append(Question(s["id"], i, q["kind"], q["q"], tuple(q["answers"]), tuple(segments), private[0]))
    return out


# --------------------------------------------------------------------------- privatizers
@dataclass(frozen=True)
class Privatized:
    """One privatized question: the ids of its user text (any length) and the receipt
    (``PromptReceipt.to_json()``, None for the reference row) plus ``info`` (calibration facts
    of the row: service epsilon, effective dim, ...)."""

    ids: tuple[int, ...]
    receipt: dict | None = None
    info: dict = field(default_factory=dict)


class Bench:
    """What a row's privatizer may use: the tokenizer, the settings, the plugin's
    ``PromptPrivacy`` service of the model (built on first use), the loaded engine ``llm`` and
    ``generate`` (greedy completions of token prompts)."""

    def __init__(self, settings: Settings, tokenizer, log: Callable[[str], None] = print) -> None:
        self.settings, self.tokenizer, self.log = settings, tokenizer, log
        self.llm = None  # set by run() once the engine is up
        self._service = None
        self.table_info: dict = {}
        self.timing: dict[str, float] = {}

    @property
    def service(self):
        if self._service is None:
            from vllm_dp_plugin.config import PromptPrivacyConfig
            from vllm_dp_plugin.serving.prompt_table import build_prompt_privacy

            start = time.perf_counter()
            cfg = PromptPrivacyConfig(delta=self.settings.delta, cache_history=False)
            self._service, info = build_prompt_privacy(self.settings.model, self.tokenizer, cfg, None)
            self.timing["table_s"] = time.perf_counter() - start
            table = self._service.table
            self.table_info = {"describe": info.describe(), "vocab_size": info.vocab_size, "dim": info.dim,
                               "candidates": info.candidates, "special": info.special,
                               "clip_norm": info.clip_norm, "ln_V": math.log(info.vocab_size),
                               "sensitivity_l1": table.sensitivity_l1, "sensitivity_linf": table.sensitivity_linf,
                               "search_device": str(self._service.device)}
            self.log(f"prompt privacy table: {info.describe()} ({self.timing['table_s']:.0f} s)")
        return self._service

    def diameter(self, name: str) -> float:
        """The table's diameter in the metric of ``name`` (``mahalanobis``: Sigma_0.5; otherwise
        l2), computed once per table (logged; minutes on 2 cores for 49k rows)."""
        from vllm_dp_plugin.prompt.mechanisms import metric_geometry

        table = self.service.table
        key = "mahalanobis_diameter" if name == "mahalanobis" else "sensitivity_l2"
        if key not in self.table_info:
            self.log(f"computing the table's {key} (once per table: {table.vocab_size}^2 x {table.dim}) ...")
            start = time.perf_counter()
            if name == "mahalanobis":
                self.table_info[key] = metric_geometry(table, MAHALANOBIS_LAMBDA)[1]
            else:
                self.table_info[key] = table.sensitivity_l2
            self.timing[f"{key}_s"] = time.perf_counter() - start
            self.log(f"  {key} = {self.table_info[key]:.6g} ({self.timing[f'{key}_s']:.0f} s)")
        return self.table_info[key]

    def outputs(self, prompts: Sequence[Sequence[int]], params) -> list:
        """vLLM's ``RequestOutput`` of every token-id prompt under ``params`` (``SamplingParams``),
        in one ``generate`` call, in order."""
        from vllm.inputs import TokensPrompt

        return self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int | None = None) -> list[str]:
        """Greedy completions (text) of token-id prompts, in one ``generate`` call."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens or self.settings.max_tokens)
        return [o.outputs[0].text for o in self.outputs(prompts, params)]


Privatizer = Callable[[Bench, "float | None", Sequence[Question]], list[Privatized]]


def reference(bench: Bench, eps: float | None, questions: Sequence[Question]) -> list[Privatized]:
    """The un-privatized question."""
    return [Privatized(q.user_ids) for q in questions]


def noise_seed(seed: int, mechanism: str, eps: float, question: str) -> bytes:
    """32 bytes seeding one question's noise (reproducible per (mechanism, eps, question))."""
    return hashlib.sha256(f"vllm-dp/bench-prompt-answers|{seed}|{mechanism}|{eps:g}|{question}".encode()).digest()


def metric_epsilon(eps: float, diameter: float) -> float:
    """Metric epsilon whose converted per-token guarantee ``eps_m * Delta`` is ``eps``."""
    return eps / diameter


def service_epsilon(bench: Bench, mechanism: str, eps: float) -> float:
    """The ``dp_epsilon`` a request sends so that ``mechanism`` guarantees per-token ``eps``."""
    if mechanism in METRIC_DP:
        return metric_epsilon(eps, bench.diameter(mechanism))
    if mechanism in NEEDS_DIAMETER:
        bench.diameter(mechanism)  # computed (and logged) once, before the first row needs it
    return eps


@contextlib.contextmanager
def configured(service, **changes):
    """``service.cfg`` with ``changes`` while the block runs (``trlap_paper``'s ``effective_dim``
    is a deployment setting, not a request option)."""
    saved = service.cfg
    service.cfg = dataclasses.replace(saved, **changes)
    try:
        yield service
    finally:
        service.cfg = saved


def token_privatizer(mechanism: str) -> Privatizer:
    """Per-token privatization by the plugin's service with ``mechanism`` at per-token ``eps``."""

    def privatize(bench: Bench, eps: float | None, questions: Sequence[Question]) -> list[Privatized]:
        service = bench.service
        request_eps = service_epsilon(bench, mechanism, eps)
        changes, info = {}, {"service_epsilon": request_eps}
        if mechanism == "trlap_paper":
            changes["effective_dim"] = info["effective_dim"] = paper_effective_dim(eps, service.table.dim)
        options = service.options({"dp_mechanism": mechanism, "dp_epsilon": request_eps})
        out = []
        with configured(service, **changes), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # reproduction modes warn; their receipts say so
            for q in questions:
                done = service.privatize(list(q.segments), options,
                                         seed=noise_seed(bench.settings.seed, mechanism, eps, q.key))
                ids = tuple(t for t, private in zip(done.ids, done.mask, strict=True) if private)
                out.append(Privatized(ids, done.receipt.to_json(), info))
        return out

    return privatize


class BenchKey:
    """A ``NoiseKey`` stand-in for the rewrites' seeds: reproducible per (bench seed, inputs)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def mac(self, *parts: str | bytes) -> bytes:
        digest = hashlib.sha256(f"vllm-dp/bench-prompt-answers-paraphrase|{self.seed}".encode())
        for part in parts:
            data = part.encode() if isinstance(part, str) else bytes(part)
            digest.update(len(data).to_bytes(8, "big") + data)
        return digest.digest()


def paraphrase(bench: Bench, eps: float | None, questions: Sequence[Question]) -> list[Privatized]:
    """The served model rewrites each question (``serving.paraphrase``: one extra generation of
    the same engine, eps per OUTPUT token, the server's default width, cap and template); the
    rewrite's tokens replace the question. The receipt composes over the cap."""
    from vllm_dp_plugin.config import PromptPrivacyConfig
    from vllm_dp_plugin.prompt.paraphrase import ParaphraseMechanism
    from vllm_dp_plugin.prompt.session import PromptPrivacy
    from vllm_dp_plugin.serving.paraphrase import paraphrase as rewrite

    cfg = PromptPrivacyConfig()
    mechanism = ParaphraseMechanism(eps, cfg.paraphrase_width, cfg.paraphrase_max_tokens)
    rewrites = rewrite(bench.llm, [q.text for q in questions], mechanism, key=BenchKey(bench.settings.seed),
                       template=cfg.paraphrase_template)
    receipt = PromptPrivacy.paraphrase_receipt(mechanism, 1).to_json()
    info = {"width": mechanism.width, "max_tokens": mechanism.max_tokens}
    return [Privatized(tuple(bench.tokenizer.encode(r.text, add_special_tokens=False)), receipt,
                       {**info, "rewrite": r.text}) for r in rewrites]


def no_question(bench: Bench, eps: float | None, questions: Sequence[Question]) -> list[Privatized]:
    """The user text removed (an empty user turn): what any mechanism tends to as eps -> 0, whose
    output no longer depends on the question; the shared-question floor the documents give alone."""
    return [Privatized(()) for _ in questions]


# name -> privatizer of a row; a new mechanism (e.g. one that needs ``bench.llm``) is one entry
PRIVATIZERS: dict[str, Privatizer] = {REFERENCE: reference, NO_QUESTION: no_question,
                                      **{m: token_privatizer(m) for m in MECHANISMS}, "paraphrase": paraphrase}


# --------------------------------------------------------------------------- rows
def unchanged(original: Sequence[int], private: Sequence[int]) -> int:
    """Original question tokens kept at their position."""
    return sum(a == b for a, b in zip(original, private, strict=False))


def receipt_total(receipt: dict | None) -> tuple[float | None, float | None]:
    """(epsilon, delta) of ``receipt.prompt.total`` (the composition over the question's tokens);
    inf where the receipt states no guarantee."""
    if receipt is None:
        return None, None
    total = receipt["prompt_total"]["min"]
    return tuple(float(total[k]) for k in ("epsilon", "delta"))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def summarize(mechanism: str, eps: float | None, questions: Sequence[Question], done: Sequence[Privatized],
              answers: Sequence[str]) -> dict:
    """One row: accuracy per kind (with a 95% Wilson CI), tokens unchanged, the receipts."""
    correct = [is_correct(a, q.answers) for q, a in zip(questions, answers, strict=True)]
    row: dict = {"mechanism": mechanism, "eps": eps, "questions": len(questions)}
    for kind in KINDS:
        hits = [c for q, c in zip(questions, correct, strict=True) if q.kind == kind]
        if hits:
            row[f"{kind}_accuracy"] = sum(hits) / len(hits)
            row[f"{kind}_ci"] = wilson(sum(hits), len(hits))
            row[f"{kind}_n"] = len(hits)
    tokens = sum(len(q.user_ids) for q in questions)
    kept = sum(unchanged(q.user_ids, p.ids) for q, p in zip(questions, done, strict=True))
    row.update(tokens=tokens, kept=kept, unchanged=kept / tokens if tokens else math.nan,
               questions_unchanged=sum(tuple(p.ids) == q.user_ids for q, p in zip(questions, done, strict=True)),
               correct=[int(c) for c in correct])
    receipts = [p.receipt for p in done if p.receipt is not None]
    if receipts:
        totals = [receipt_total(r) for r in receipts]
        first = receipts[0]
        row.update(
            epsilon_token=first["epsilon_token"], delta_token=first["delta_token"], valid=first["valid"],
            statement=first["statement"],
            total_epsilon=_mean([e for e, _ in totals]), total_delta=_mean([d for _, d in totals]),
            tokens_privatized=_mean([r["tokens_privatized"] for r in receipts]),
        )
        row.update({k: v for k, v in done[0].info.items()})
    if mechanism in REPRODUCTION and eps is not None:
        row["claimed_total_epsilon"] = eps * row["tokens"] / len(questions)
    return row


def _mean(values: Sequence) -> float:
    vals = [float("inf") if v == "inf" else float(v) for v in values]
    return sum(vals) / len(vals) if vals else math.nan


def failed(mechanism: str, eps: float | None, exc: BaseException) -> dict:
    return {"mechanism": mechanism, "eps": eps, "error": f"{type(exc).__name__}: {exc}"}


def example_texts(tokenizer, questions: Sequence[Question], done: Sequence[Privatized], answers: Sequence[str],
                  picks: Sequence[int]) -> list[dict]:
    return [{"question": questions[i].key, "kind": questions[i].kind,
             "text": tokenizer.decode(list(done[i].ids)), "answer": answers[i],
             "correct": is_correct(answers[i], questions[i].answers)} for i in picks]


def example_picks(questions: Sequence[Question]) -> list[int]:
    """The first question of each kind."""
    seen: dict[str, int] = {}
    for i, q in enumerate(questions):
        seen.setdefault(q.kind, i)
    return [seen[k] for k in KINDS if k in seen]


# --------------------------------------------------------------------------- driver
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
    bar = Progress(settings.progress).bar(len(jobs), "bench prompt --answers")
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


# --------------------------------------------------------------------------- report
def stem(settings: Settings, results: dict) -> Path:
    return Path(settings.out) / f"{SUITE}-{results.get('device', 'cpu')}-{settings.date}"


def write_results(results: dict, settings: Settings) -> list[Path]:
    base = stem(settings, results)
    files = [suffixed(base, ".md"), suffixed(base, ".json"), suffixed(base, ".png")]
    results["files"] = [str(p) for p in files]
    results["notes"] = notes(results)
    write_json(files[1], results, indent=1)
    plot(results, files[2])
    write_text(files[0], markdown(results, settings))
    return files


def grid(results: dict) -> list[float]:
    return sorted({r["eps"] for r in results["rows"] if r["eps"] is not None})


def reference_row(results: dict) -> dict | None:
    return baseline_row(results, REFERENCE)


def baseline_row(results: dict, name: str) -> dict | None:
    return next((r for r in results["rows"] if r["mechanism"] == name and "error" not in r), None)


def mechanism_rows(results: dict) -> list[dict]:
    return [r for r in results["rows"] if r["mechanism"] not in BASELINES]


def label(name: str) -> str:
    if name in METRIC_DP:
        return f"{name} (at eps = eps_m * Delta)"
    if name in REPRODUCTION:
        return f"{name} (claimed eps; not DP)"
    if name == "paraphrase":
        return "paraphrase (eps per OUTPUT token, cap 32)"
    return name


def pivot(results: dict, cell: Callable[[dict], str]) -> list[list[str]]:
    eps = grid(results)
    rows = mechanism_rows(results)
    by = {(r["mechanism"], r["eps"]): r for r in rows}
    mechs = list(dict.fromkeys(r["mechanism"] for r in rows))
    return [[label(m)] + [("n/a" if "error" in by[(m, e)] else cell(by[(m, e)])) if (m, e) in by else ""
                          for e in eps] for m in mechs]


def _acc(r: dict, kind: str) -> str:
    return f"{r[f'{kind}_accuracy']:.2f}" if f"{kind}_accuracy" in r else ""


def _receipt_cell(r: dict) -> str:
    """``eps (delta)`` of the receipt's total; reproductions state no guarantee (their claim is shown)."""
    eps = r.get("total_epsilon")
    if eps is None or math.isinf(eps):
        claimed = r.get("claimed_total_epsilon")
        return "no guarantee" + (f" (claimed {fmt(claimed)})" if claimed is not None else "")
    return f"{fmt(eps)} ({fmt(r.get('total_delta'))})"


def markdown(results: dict, settings: Settings) -> str:
    info, data, s = results["machine"], results["data"], results["settings"]
    table = results.get("table", {})
    ref = reference_row(results)
    floor = baseline_row(results, NO_QUESTION)
    eps = grid(results)
    heads = ["mechanism"] + [f"eps={e:g}" for e in eps]
    stages = ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in results["timing"].items())
    desc = f"{info.get('cpu', '?')}, {info['cpu_count']} logical cores, {info.get('ram_gib', '?')} GiB RAM"
    if "gpu" in info:
        desc = f"{info['gpu']}; host {desc}"
    q = data["questions"]
    lo, mean, hi = data["question_tokens"]
    out = [
        f"# Prompt privatization: answer accuracy on {Path(s['model']).name} ({info['label']}, {s['date']})",
        "",
        f"- Machine: {desc}; {info['platform']}",
        f"- Python {info['python']}, torch {info['torch']}, vLLM {results['engine']['vllm']}",
        f"- Command: `{s['command']}`",
        (f"- Wall time: {results['runtime_s'] / 60:.1f} min ({stages}; privatize includes the diameters and "
         "the reproduction modes' true-delta search)"
         + (" (**--quick**: smoke-test sizes)" if s["quick"] else "")),
        (f"- Questions: {data['scenarios']} scenarios of `{Path(s['scenarios']).name}`: {q['public']} public "
         f"(no system prompt), {q['shared']} shared and {q['secret']} secret (the scenario's documents as a "
         f"plain system prompt, one per line; NOT private here). Private: the user's question only, "
         f"{lo}/{mean:.1f}/{hi} tokens (min/mean/max), located as the server's renderer does "
         "(`segment_chat`); template and system prompt pass through."),
        (f"- Privatization: the plugin's `PromptPrivacy` service of the model "
         f"(`build_prompt_privacy`; table: {table.get('describe', 'n/a')}), one `privatize` call per question "
         f"with `dp_mechanism`/`dp_epsilon`, noise seeded per (mechanism, eps, question) from seed {s['seed']}; "
         f"delta = {s['delta']:g} per token for trlap_corrected and gaussian_analytic."),
        (f"- Generation: offline vLLM ({', '.join(f'{k}={v}' for k, v in results['engine']['llm'].items())}), "
         f"VLLM_PLUGINS={results['engine']['vllm_plugins']!r}, greedy, {s['max_tokens']} tokens, token-id "
         "prompts, one `generate` call per row. Correct: one of the question's answers occurs in the "
         "completion (case-insensitive)."),
        "",
        f"![answer accuracy vs eps]({Path(results['files'][2]).name})",
        "",
        ("Per-token eps on the grid is what each mechanism guarantees per token (any token vs any token). "
         "`mahalanobis`/`cmp` (metric DP) are run at eps_m = eps / Delta (Delta: the table's diameter in "
         "their metric), so their converted guarantee equals the grid value. `trlap_paper`/`trlap_repro` "
         "are reproductions whose claimed delta is false: not DP, shown at the claimed eps (their receipt "
         "states no guarantee: total eps inf). n/a: the calibration is undefined at that eps."),
        "",
    ]
    for kind in KINDS:
        key = f"{kind}_accuracy"
        if ref is None or key not in ref:
            continue
        lo_ci, hi_ci = ref[f"{kind}_ci"]
        out += [
            f"## Answer accuracy, {kind} questions (n = {ref[f'{kind}_n']})",
            "",
            (f"Reference (un-privatized question): **{ref[key]:.2f}** (95% CI [{lo_ci:.2f}, {hi_ci:.2f}])"
             + (f"; question removed (empty user turn, the eps -> 0 end): {floor[key]:.2f}"
                if floor is not None and key in floor else "") + "."),
            "",
            md_table(heads, pivot(results, lambda r, k=kind: _acc(r, k))),
            "",
        ]
    out += [
        "## Question tokens unchanged (fraction, at their position)",
        "",
        md_table(heads, pivot(results, lambda r: f"{r['unchanged']:.2f}")),
        "",
        "## What the receipt says was spent for the whole question",
        "",
        ("`receipt.prompt.total` (the smaller of basic and advanced composition over the question's "
         "private tokens), mean over questions: epsilon (delta). Reproduction modes: the receipt states no "
         "guarantee; their claim (n x the claimed per-token eps) is in brackets."),
        "",
        md_table(heads, pivot(results, _receipt_cell)),
        "",
    ]
    metric = [r for r in mechanism_rows(results) if r["mechanism"] in METRIC_DP and "service_epsilon" in r]
    if metric:
        out += ["Metric epsilon eps_m sent as `dp_epsilon` for the metric-DP rows (diameters: "
                + ", ".join(f"{k} = {fmt(table[k], 5)}" for k in ("sensitivity_l2", "mahalanobis_diameter")
                            if k in table) + "):", "",
                md_table(heads, pivot({"rows": metric}, lambda r: fmt(r["service_epsilon"], 4))), ""]
    repro = [r for r in mechanism_rows(results) if r["mechanism"] in REPRODUCTION]
    if repro:
        out += [("Reproduction rows (not DP): per-token delta the receipt states (true delta, lower bound) "
                 "and trlap_paper's d_eff:"), "",
                md_table(["mechanism", "eps (claimed)", "d_eff", "true delta per token >=", "status"], [
                    [r["mechanism"], f"{r['eps']:g}", r.get("effective_dim", ""), fmt(r.get("delta_token")),
                     "ok" if "error" not in r else "undefined: " + r["error"][:120]] for r in repro]), ""]
    errors = [r for r in results["rows"] if "error" in r]
    if errors:
        out += ["## Rows that could not run (n/a)", ""]
        out += [f"- {r['mechanism']} eps={r['eps']:g}: {r['error'][:300]}" for r in errors] + [""]
    if results["examples"]:
        out += ["## Examples (first question of each kind)", ""]
        heads_ex = ["row"] + [f"{e['kind']} `{e['question']}`" for e in next(iter(results["examples"].values()))]
        out += [md_table(heads_ex, [
            [k.replace("@-", "").replace("@", " eps=")]
            + [f"{_quote(e['text'])} -> {_quote(e['answer'][:80])} {'(correct)' if e['correct'] else ''}"
               for e in ex]
            for k, ex in results["examples"].items()]), ""]
    out += ["## Notes", ""] + [f"- {n}" for n in results["notes"]] + [""]
    out += ["## Files", ""] + [f"- `{Path(p).name}`" for p in results["files"]] + [""]
    return "\n".join(out)


def _quote(text: str) -> str:
    return '"' + " ".join(text.split()).replace("|", "\\|") + '"'


def eps_reaching(rows: Sequence[dict], name: str, key: str, level: float) -> float | None:
    hits = [r["eps"] for r in rows if r["mechanism"] == name and r.get(key, -1) >= level]
    return min(hits) if hits else None


def notes(results: dict) -> list[str]:
    ref = reference_row(results)
    rows = mechanism_rows(results)
    if ref is None:
        return ["the reference row failed: no comparison possible"]
    lines = []
    for kind in ("shared", "public"):
        key = f"{kind}_accuracy"
        if key not in ref:
            continue
        target = 0.9 * ref[key]
        found = []
        for name in dict.fromkeys(r["mechanism"] for r in rows):
            e = eps_reaching(rows, name, key, target)
            found.append(f"`{name}` {'never on this grid' if e is None else f'eps = {e:g}'}")
        lines.append(f"{kind}: smallest per-token eps reaching 90% of the reference accuracy "
                     f"({ref[key]:.2f}): " + ", ".join(found) + ".")
    return lines


def plot(results: dict, path: Path) -> None:
    """Top: accuracy vs per-token eps, one panel per kind; bottom: accuracy vs the receipt's total
    eps for the whole question (log x; reproductions at n x the claimed eps). Reference dashed."""
    plt = pyplot()
    ref = reference_row(results)
    floor = baseline_row(results, NO_QUESTION)
    kinds = [k for k in KINDS if ref is not None and f"{k}_accuracy" in ref] or list(KINDS)
    fig, axes = plt.subplots(2, len(kinds), figsize=(6 * len(kinds), 9.5), squeeze=False)
    names_ = list(dict.fromkeys(r["mechanism"] for r in mechanism_rows(results)))
    order = list(dict.fromkeys((*MECHANISMS, *names_)))
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(order)}
    markers = {m: "osD^vP*Xph"[i % 10] for i, m in enumerate(order)}
    handles = {}
    for col, kind in enumerate(kinds):
        key = f"{kind}_accuracy"
        for name in names_:
            pts = sorted((r for r in mechanism_rows(results) if r["mechanism"] == name and key in r),
                         key=lambda r: r["eps"])
            if not pts:
                continue
            style = "--" if name in METRIC_DP else (":" if name in REPRODUCTION else "-")
            (line,) = axes[0][col].plot([r["eps"] for r in pts], [r[key] for r in pts], style, marker=markers[name],
                                        ms=5, mfc="none", color=colors[name], label=label(name))
            handles[name] = line
            total = [(r.get("claimed_total_epsilon") if name in REPRODUCTION else r.get("total_epsilon"), r[key])
                     for r in pts]
            total = [(x, y) for x, y in total if x is not None and math.isfinite(x) and x > 0]
            if total:
                axes[1][col].plot(*zip(*total, strict=True), style, marker=markers[name], ms=5, mfc="none",
                                  color=colors[name])
        for row_axes in axes:
            ax = row_axes[col]
            if ref is not None and key in ref:
                ref_line = ax.axhline(ref[key], color="black", ls="--", lw=1.2,
                                      label="un-privatized question (reference)")
                handles["reference"] = ref_line
            if floor is not None and key in floor:
                handles["floor"] = ax.axhline(floor[key], color="grey", ls=":", lw=1.2,
                                              label="question removed (the eps -> 0 end)")
            ax.set_ylim(-0.02, 1.02)
            ax.set_xscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_ylabel(f"{kind} answer accuracy")
        axes[0][col].set_title(f"{kind} questions (n = {ref.get(f'{kind}_n', '?') if ref else '?'})")
        axes[0][col].set_xlabel("per-token eps (metric DP: eps_m * Delta; reproductions: claimed)")
        axes[1][col].set_xlabel("receipt total eps for the whole question (mean; reproductions: n x claimed)")
    fig.legend(handles=list(handles.values()), loc="lower center", ncol=5, fontsize=8, frameon=False)
    data = results["data"]
    fig.suptitle(f"Answer accuracy on privatized questions, {Path(results['settings']['model']).name}: "
                 f"{data['scenarios']} scenarios, {sum(data['questions'].values())} questions", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    save_figure(fig, path, dpi=100)


# --------------------------------------------------------------------------- CLI
def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser
    add_quick_arg(p, "smoke test: laplace + trlap_corrected at eps 20 and 200, 3 scenarios")
    add_out_arg(p)
    p.add_argument("--model", help=f"chat model directory (default {DEFAULT_MODEL})")
    p.add_argument("--scenarios", help="scenarios JSONL (default the bundled context-scenarios.jsonl)")
    p.add_argument("--limit", type=int, help="first N scenarios only (default all 24)")
    p.add_argument("--mechanisms", type=names,
                   help=f"comma list (default all: {','.join(m for m in PRIVATIZERS if m not in BASELINES)}); "
                        f"the {' and '.join(BASELINES)} rows always run")
    p.add_argument("--eps", dest="epsilons", type=floats, help="per-token eps grid (default 5,10,20,50,100,200)")
    p.add_argument("--seed", type=int, help="noise seed (default 0)")
    p.add_argument("--delta", type=float, help="per-token delta of trlap_corrected/gaussian_analytic (default 1e-6)")
    add_date_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar or log lines")
    p.add_argument("--append", action="store_true",
                   help="merge these rows into the day's saved results (same questions): replaces rows of the same (mechanism, eps)")
    p.add_argument("--render", type=Path, metavar="JSON", help="only re-render the markdown/plot of a saved results JSON")
    return p


def build_parser(prog: str = "vllm-dp bench prompt-answers") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(
        prog=prog,
        description="(Also `vllm-dp bench prompt --answers`.) Answer accuracy of SmolLM2-135M-Instruct on questions privatized per token by the "
        "plugin's prompt privacy service, every mechanism vs per-token eps and vs the receipt's total eps, "
        "with the un-privatized question as reference. Writes md/json/png.",
    ))


def settings_from_args(args: argparse.Namespace, argv: Sequence[str] | None) -> Settings:
    base = Settings.quick_defaults() if args.quick else {}
    for key in ("model", "scenarios", "limit", "mechanisms", "epsilons", "seed", "delta"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    return Settings(out=args.out, quick=args.quick, progress=not args.no_progress, append=args.append, date=args.date,
                    command=command_line("vllm-dp bench prompt-answers", argv), **base)


def load_results(path: Path) -> tuple[dict, Settings]:
    results = read_json(path)
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in results["settings"].items()}
    saved["out"] = Path(path).parent
    known = set(Settings.__dataclass_fields__)
    return results, Settings(**{k: v for k, v in saved.items() if k in known})


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed options (``add_cli_args``) or an argv list (``vllm-dp bench prompt --answers ...``)."""
    args, argv = parse(args, build_parser)
    if args.render:
        results, settings = load_results(args.render)
        write_results(results, settings)
    else:
        results = run(settings_from_args(args, argv))
    print()
    for row in results["rows"]:
        print(describe(row))
    for line in results["notes"]:
        print(line)
    print(f"runtime {results['runtime_s'] / 60:.1f} min; results:")
    for path in results["files"]:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
