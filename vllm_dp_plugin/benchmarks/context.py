"""``vllm-dp bench context``: does a private context still inform answers, and does it leak?

A real chat model is asked questions about a set of short documents served as its context:

* ``shared``: a fact stated (paraphrased) by ``support`` documents, support in {1, 3, 10, 20};
  what a private context should still deliver when many documents agree;
* ``secret``: a fact stated by exactly one document (the leak canary): what DP should hide;
* ``public``: a question that needs no context (capital cities, arithmetic): whether the context,
  private or not, makes ordinary answers worse.

An answer is correct when any of the question's ``answers`` occurs (case-insensitive) in the
first 32 greedy tokens (``temperature 0``, ``max_tokens 32``).

Rows (``ROWS``, one entry per way of serving; a new mechanism is one more entry):

* ``none``: no context, the user turn alone (stock vLLM);
* ``full``: the documents in plain text before the user turn (stock vLLM, exact attention);
* ``dp_state`` / ``dp_tree``: the documents as the private context (``vllm-dp serve``, DP
  attention, mode ``state`` / ``tree``, default settings: public head ``auto``, gate 0.5), at
  each eps of ``--eps`` (eps = 1e7 shows the kernel error alone; accounted with ``basic``
  composition, which PLD refuses beyond eps = 100); the levers one by one:
  ``dp_state_head`` (public head, gate off), ``dp_state_bare`` / ``dp_tree_bare`` (no public
  head, no gate: every context token private and every release read, the paper's setting);
  ``dp_state_doc`` / ``dp_state_doc_open``: unit document (each scenario's collection, one slot
  of 64 tokens per document, documents encoded independently), default gate / gate off;
* ``aggregate_vote`` / ``aggregate_expmech``: DP aggregation at the output (``dp_privacy.aggregate``
  with the recommended settings), each scenario's documents one collection, eps per query; the
  request is the user turn alone (the public sequence; members get their documents before it);
  ``aggregate_answer``: the same collections under ``mechanism: answer`` (one DP release per
  answer; eps = 1e7 is its noise-free row: threshold 2, no noise).

``--speed`` measures time per output token instead (``speed``).

Every row sees the same token sequence: ``C`` = the chat template's system turn holding the
documents (one per line), then the user turn with the generation prompt; ``none`` drops ``C``.
The DP renderer puts ``C`` at positions [0, P) and the request's own ids after it, so DP rows
send only the user turn (token ids; a leading BOS that the renderer would drop is doubled) and
pick the scenario's context with ``vllm_xargs: {"dp_context": ID}``. Each request's
``usage.prompt_tokens`` is checked against the expected length.

One server per (row, eps) (rows with the same server, ``none`` and ``full``, share one; a row
with ``contexts_per_server`` splits the scenarios over several servers: ``dp_tree``'s releases
are GBs), 8 requests in flight. DP rows use a key file and a release ledger in a temporary
directory of the run (never the operator's) and a calibration of the model on public text, cached
in ``--cache-dir``. Writes ``context-<device>-<date>.{md,json,png}`` into ``--out``; with
``--append`` the rows of an existing file of that name that this run does not measure are kept
(add one mechanism without re-running the others).

Scenarios: ``vllm_dp_plugin/benchmarks/data/context-scenarios.jsonl`` (24, ``--make-scenarios`` with seed 0),
one JSON object per line::

    {"id": str, "documents": [str, ...],
     "questions": [{"q": str, "answers": [str, ...], "kind": "shared" | "secret" | "public",
                    "support": int}, ...]}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import random
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dp_plugin.aggregate.facts import FactSheet
from vllm_dp_plugin.benchmarks.lib import vllm as vllm_lib
from vllm_dp_plugin.benchmarks.lib.cli import DEFAULT_OUT, parse, today
from vllm_dp_plugin.benchmarks.lib.environment import default_device, device_label
from vllm_dp_plugin.benchmarks.lib.report import (
    pyplot,
    save_figure,
    suffixed,
    write_json,
    write_text,
)
from vllm_dp_plugin.benchmarks.lib.scenarios import (
    ANSWER_TOKENS,
    DEFAULT_CACHE,
    DEFAULT_MODEL,
    DEFAULT_MODEL_NAME,
    DEFAULT_SCENARIOS,
    KINDS,
    ChatLayout,
    cached_calibration,
    check_scenario,
    ensure_model,
    is_correct,
    load_scenarios,
)
from vllm_dp_plugin.benchmarks.lib.vllm import LAUNCH, VLLM_DP
from vllm_dp_plugin.serving.memory import kv_cache_flags, kv_shape

DOCUMENT_TOKENS = 64  # unit document rows: the scenarios' longest document is 53 SmolLM2 tokens
DEFAULT_EPS = (1.0, 4.0, 8.0, 64.0)
KERNEL_ONLY_EPS = 1e7  # noise negligible: what remains is the kernel (feature map) error
MAX_CURVE_EPS = 100.0  # pld accounting refuses larger eps (config.MAX_CURVE_EPSILON)
DELTA = 1e-6
SUPPORTS = (1, 3, 10, 20)
ROW_KEYS = ("row", "eps", "shared_accuracy", "secret_leak_rate", "public_accuracy",
            "seconds_per_answer", "n_questions")
# Every server's engine; Bench.engine_flags adds the model's own --max-model-len and the KV cache in bytes.
ENGINE_FLAGS = ["--dtype", "float32", "--block-size", "32", "--enforce-eager", "--seed", "0"]


# =========================================================================== scenario generator
# Fictional names come from syllables, so the model cannot know the facts; every template below
# is ours. Documents are short (1-2 sentences) and carry a document-type label.
ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "pr", "qu", "r",
          "s", "st", "t", "tr", "v", "z", "th", "sk")
VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "ou")
CODAS = ("", "", "", "n", "r", "l", "s", "k", "nd", "rk", "lt", "m")
COMPANY_SUFFIXES = ("Labs", "Industries", "Works", "Group", "Systems", "Foods", "Logistics", "Textiles",
                    "Robotics", "Brewing", "Instruments", "Mills")
CITY_SUFFIXES = ("ford", "moor", "haven", "bury", "wick", "dale", "port", "stead")
DOC_LABELS = ("Memo", "Newsletter", "Staff handbook", "Press release", "Meeting notes", "FAQ", "Email",
              "Annual report", "Wiki page", "Onboarding guide", "Blog post", "Notice board",
              "Board minutes", "Customer letter", "Intranet", "Training slides", "Team chat",
              "Brochure", "Site guide", "Policy", "Bulletin", "Fact sheet", "Interview", "Report")


@dataclass(frozen=True)
class FactKind:
    """A kind of fact about the scenario's company: its question, the value's kind and the
    sentences stating it (``{C}`` company, ``{V}`` value)."""

    name: str
    question: str
    value: str  # person | place | number | word | product | password
    statements: tuple[str, ...]


SHARED_FACTS = (
    FactKind("ceo", "Who is the chief executive of {C}?", "person", (
        "{V} is the chief executive of {C}.",
        "The chief executive of {C} is {V}.",
        "{C} is led by its chief executive, {V}.",
        "{C}'s chief executive, {V}, chairs the weekly meeting.",
        "As chief executive, {V} signs every contract at {C}.",
        "{V} has served as chief executive of {C} for six years.",
        "All department heads at {C} report to the chief executive, {V}.",
        "The office of {C}'s chief executive, {V}, is on the top floor.",
        "{V}, the chief executive of {C}, opened the new warehouse.",
        "Questions about strategy go to {V}, chief executive of {C}.",
    )),
    FactKind("headquarters", "In which city is {C} headquartered?", "place", (
        "{C} is headquartered in {V}.",
        "The headquarters of {C} are in the city of {V}.",
        "{C} runs its business from its head office in {V}.",
        "{V} is the city where {C} has its headquarters.",
        "Visitors to the headquarters of {C} travel to {V}.",
        "{C} moved its headquarters to {V} long ago.",
        "The head office of {C} stands in the centre of {V}.",
        "Most staff of {C} work at the headquarters in {V}.",
        "Board meetings of {C} are held at the headquarters in {V}.",
        "From its headquarters in {V}, {C} serves customers worldwide.",
    )),
    FactKind("employees", "How many employees does {C} have?", "number", (
        "{C} has {V} employees.",
        "The staff of {C} numbers {V} employees.",
        "{C} employs {V} people.",
        "With {V} employees, {C} is a large employer.",
        "The payroll of {C} lists {V} employees.",
        "Exactly {V} employees work for {C}.",
        "{C} counts {V} employees on its staff.",
        "The headcount at {C} is {V} employees.",
        "All {V} employees of {C} attended the summer party.",
        "{C} reported a workforce of {V} employees.",
    )),
    FactKind("mascot", "What is the name of {C}'s mascot?", "word", (
        "The mascot of {C} is called {V}.",
        "{V} is the name of {C}'s mascot.",
        "The mascot of {C} is named {V}.",
        "Children love {V}, the mascot of {C}.",
        "{C} puts its mascot, {V}, on every box.",
        "At every fair, the mascot of {C}, {V}, waves to the crowd.",
        "The costume of {V}, the mascot of {C}, is bright green.",
        "{C} chose {V} as its mascot.",
        "Fans of {C} cheer for its mascot {V}.",
        "Everyone at {C} knows the mascot {V}.",
    )),
    FactKind("product", "What is the name of {C}'s best-selling product?", "product", (
        "The best-selling product of {C} is the {V}.",
        "{C}'s best-selling product is called the {V}.",
        "The {V} is {C}'s best-selling product.",
        "Customers buy the {V} more than any other product of {C}.",
        "No product of {C} sells better than the {V}.",
        "{C} makes most of its money from its best-selling product, the {V}.",
        "Stores stock the {V}, the best-selling product of {C}.",
        "The {V} remains the best-selling product of {C}.",
        "Sales of the {V} make it {C}'s best-selling product.",
        "Ask anyone: the best-selling product of {C} is the {V}.",
    )),
    FactKind("ship", "What is the name of {C}'s cargo ship?", "word", (
        "The cargo ship of {C} is called the {V}.",
        "{C} sends its goods overseas on its cargo ship, the {V}.",
        "The {V} is the cargo ship of {C}.",
        "{C}'s cargo ship, the {V}, sails every week.",
        "Goods from {C} travel on the cargo ship {V}.",
        "The cargo ship {V} carries the name of {C} on its side.",
        "{C} owns one cargo ship, named the {V}.",
        "Sailors on the {V}, the cargo ship of {C}, are proud of it.",
        "The {V} is the name of the cargo ship that {C} owns.",
        "Every month the cargo ship of {C}, the {V}, docks at the harbour.",
    )),
    FactKind("extension", "What is the phone extension of {C}'s help desk?", "number", (
        "The help desk of {C} answers on phone extension {V}.",
        "To reach the help desk of {C}, dial phone extension {V}.",
        "Phone extension {V} rings the help desk of {C}.",
        "The phone extension of {C}'s help desk is {V}.",
        "Staff at {C} call the help desk on extension {V}.",
        "{C}'s help desk can be reached on phone extension {V}.",
        "For computer problems, {C} staff ring the help desk at extension {V}.",
        "The help desk phone extension at {C} is {V}.",
        "Dial extension {V} for the help desk of {C}.",
        "The help desk of {C} picks up calls on extension {V}.",
    )),
    FactKind("river", "Which river flows past {C}'s main office?", "word", (
        "The {V} River flows past the main office of {C}.",
        "{C}'s main office stands on the bank of the {V} River.",
        "From the main office of {C} you can see the {V} River.",
        "The main office of {C} overlooks the {V} River.",
        "Staff of {C} walk along the {V} River at lunch, right by the main office.",
        "The {V} River runs beside {C}'s main office.",
        "{C} built its main office next to the {V} River.",
        "Boats on the {V} River pass the main office of {C}.",
        "The river by {C}'s main office is the {V} River.",
        "In spring the {V} River floods the garden of {C}'s main office.",
    )),
)

SECRET_FACTS = (
    FactKind("password", "What is the password for the {C} server room?", "password", (
        "The password for the {C} server room is {V}.",
    )),
    FactKind("project", "What is the name of {C}'s secret research project?", "word", (
        "The secret research project of {C} is called {V}.",
    )),
    FactKind("codename", "What is the secret code name of {C}'s next product?", "word", (
        "The secret code name of {C}'s next product is {V}.",
    )),
)

FILLERS = (
    "{C} encourages staff to take regular breaks.",
    "The cafeteria at {C} serves soup on cold days.",
    "Visitors to {C} must sign in at the front desk.",
    "{C} recycles all of its office paper.",
    "The parking lot at {C} is repainted every spring.",
    "Staff at {C} can borrow books from the office library.",
    "{C} holds a charity run every autumn.",
    "Meeting rooms at {C} must be booked in advance.",
    "{C} offers free coffee in the kitchen.",
    "The windows at {C} are cleaned every month.",
    "New employees at {C} get a welcome pack.",
    "{C} asks staff to lock their screens when away.",
    "The garden behind the office of {C} has a small pond.",
    "{C} sponsors a local football team.",
    "Printers at {C} are serviced on Fridays.",
    "Everyone at {C} is invited to the winter party.",
)

# Questions that need no context; each was answered correctly by SmolLM2-135M-Instruct with no
# context (greedy, 32 tokens) when the default set was made.
PUBLIC_QUESTIONS = (
    ("What is the capital of France?", ("Paris",)),
    ("What is 7 + 5?", ("12", "twelve")),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("How many days are there in a week?", ("7", "seven")),
    ("What is the capital of Italy?", ("Rome",)),
    ("What is the opposite of hot?", ("cold",)),
    ("What is the capital of Germany?", ("Berlin",)),
    ("What is 9 + 8?", ("17", "seventeen")),
    ("What is the capital of Spain?", ("Madrid",)),
    ("How many hours are there in a day?", ("24", "twenty-four")),
    ("What is the capital of England?", ("London",)),
    ("What is the opposite of up?", ("down",)),
    ("What is the capital of Russia?", ("Moscow",)),
    ("What is 3 + 4?", ("7", "seven")),
    ("What is the capital of Egypt?", ("Cairo",)),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What is the capital of Greece?", ("Athens",)),
    ("What is the opposite of day?", ("night",)),
    ("What is the capital of China?", ("Beijing",)),
    ("What is 8 + 6?", ("14", "fourteen")),
    ("What is the capital of Canada?", ("Ottawa",)),
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("What is the capital of the Netherlands?", ("Amsterdam",)),
    ("What language is spoken in Spain?", ("Spanish",)),
    ("What is the capital of Sweden?", ("Stockholm",)),
    ("What is the largest ocean on Earth?", ("Pacific",)),
    ("What is the capital of Norway?", ("Oslo",)),
    ("What is the chemical formula of water?", ("H2O",)),
    ("What is the capital of Poland?", ("Warsaw",)),
    ("What is the capital of Thailand?", ("Bangkok",)),
    ("What is the capital of Kenya?", ("Nairobi",)),
    ("What is the capital of Peru?", ("Lima",)),
    ("What is the capital of Hungary?", ("Budapest",)),
    ("What is the capital of India?", ("Delhi",)),
    ("What is the capital of Mexico?", ("Mexico City",)),
    ("What is the capital of Australia?", ("Canberra",)),
)


def _fill(template: str, company: str, value: str = "") -> str:
    return template.format(C=company, V=value).replace("s's ", "s' ")


def made_up_word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables)).capitalize()


class _Names:
    """Fresh made-up names for one scenario: none is a substring of another (case-insensitive),
    so an answer never matches a different fact."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, []

    def fresh(self, make: Callable[[], str]) -> str:
        while True:
            name = make()
            low = name.lower()
            if len(low) >= 4 and not any(low in u or u in low for u in self.used):
                self.used.append(low)
                return name

    def word(self, syllables: int = 2) -> str:
        return self.fresh(lambda: made_up_word(self.rng, syllables))

    def number(self, digits: int) -> str:
        return self.fresh(lambda: str(self.rng.randrange(10 ** (digits - 1) + 10 ** (digits - 2), 10**digits)))


def _value(kind: str, names: _Names) -> tuple[str, list[str]]:
    """(the value as the documents state it, the accepted answers; the first occurs verbatim)."""
    if kind == "person":
        first, last = names.word(), names.word()
        return f"{first} {last}", [last]
    if kind == "place":
        return (place := names.fresh(lambda: made_up_word(names.rng, 2) + names.rng.choice(CITY_SUFFIXES))), [place]
    if kind == "number":
        n = names.number(4)
        return n, [n, f"{n[0]},{n[1:]}"]
    if kind == "product":
        word = names.word()
        return f"{word} {names.rng.choice(('X', 'Pro', 'Max', 'Mini', 'Plus'))}", [word]
    if kind == "password":
        word = names.fresh(lambda: made_up_word(names.rng, 2).lower() + str(names.rng.randrange(10, 100)))
        return word, [word]
    if kind == "word":
        word = names.word()
        return word, [word]
    raise ValueError(f"unknown value kind {kind!r}")


def make_scenario(rng: random.Random, index: int, supports: Sequence[int] = SUPPORTS, extra_docs: int = 4,
                  public: int = 2) -> dict:
    """One scenario: a fictional company, ``len(supports)`` shared facts (fact i stated by
    ``supports[i]`` documents, each in its own paraphrase where the templates allow), one secret
    (one document), ``public`` public questions, ``max(supports) + extra_docs`` documents of 1-2
    sentences; the rest of the documents are filler."""
    names = _Names(rng)
    company = f"{names.word()} {rng.choice(COMPANY_SUFFIXES)}"
    n_docs = max(supports) + extra_docs
    kinds = rng.sample(SHARED_FACTS, len(supports))
    secret_kind = SECRET_FACTS[index % len(SECRET_FACTS)]
    facts = []  # (kind, support, value, answers, question kind)
    for kind, support in zip(kinds, supports, strict=True):
        facts.append((kind, support, *_value(kind.value, names), "shared"))
    facts.append((secret_kind, 1, *_value(secret_kind.value, names), "secret"))
    # place the statements: most-supported fact first, each into the least-filled documents
    docs: list[list[str]] = [[] for _ in range(n_docs)]
    for kind, support, value, _, _ in sorted(facts, key=lambda f: -f[1]):
        order = sorted(range(n_docs), key=lambda d: (len(docs[d]), rng.random()))
        templates = list(kind.statements)
        rng.shuffle(templates)
        for j, d in enumerate(order[:support]):
            docs[d].append(_fill(templates[j % len(templates)], company, value))
    fillers = rng.sample(FILLERS, len(FILLERS))
    for d, sentences in enumerate(docs):
        if not sentences or (len(sentences) == 1 and rng.random() < 0.3):
            sentences.append(_fill(fillers[d % len(fillers)], company))
        rng.shuffle(sentences)
    labels = rng.sample(DOC_LABELS, n_docs) if n_docs <= len(DOC_LABELS) else [rng.choice(DOC_LABELS) for _ in docs]
    documents = [f"{label}: {' '.join(sentences)}" for label, sentences in zip(labels, docs, strict=True)]
    rng.shuffle(documents)
    questions = [{"q": _fill(kind.question, company), "answers": answers, "kind": qkind, "support": support}
                 for kind, support, _, answers, qkind in facts]
    for j in range(public):
        q, answers = PUBLIC_QUESTIONS[(index * public + j) % len(PUBLIC_QUESTIONS)]
        questions.append({"q": q, "answers": list(answers), "kind": "public", "support": 0})
    scenario = {"id": f"s{index:03d}", "documents": documents, "questions": questions}
    check_scenario(scenario)
    return scenario


def make_scenarios(count: int, seed: int = 0) -> list[dict]:
    """``count`` scenarios, deterministic in ``seed``."""
    rng = random.Random(seed)
    return [make_scenario(rng, i) for i in range(count)]


def write_scenarios(scenarios: Sequence[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in scenarios), encoding="utf-8")
    return path


# =========================================================================== scoring
@dataclass
class Answer:
    scenario: str
    kind: str
    support: int
    correct: bool
    text: str
    prompt_tokens: int


def summarize(row: str, eps: float | None, answers: Sequence[Answer], seconds: float) -> dict:
    """One result row (exactly ``ROW_KEYS``): accuracy per support of shared facts, the share of
    secrets answered (leak rate), public accuracy, wall seconds per answer."""

    def rate(xs):
        return sum(a.correct for a in xs) / len(xs) if xs else float("nan")

    shared = [a for a in answers if a.kind == "shared"]
    supports = sorted({a.support for a in shared})
    return {"row": row, "eps": eps,
            "shared_accuracy": {str(s): rate([a for a in shared if a.support == s]) for s in supports},
            "secret_leak_rate": rate([a for a in answers if a.kind == "secret"]),
            "public_accuracy": rate([a for a in answers if a.kind == "public"]),
            "seconds_per_answer": seconds / max(1, len(answers)),
            "n_questions": len(answers)}


def unfit(row: str, eps: float | None, why: str) -> dict:
    """The result row of a row that could not run (``why`` in ``note``; no answers)."""
    return {"row": row, "eps": eps, "shared_accuracy": {}, "secret_leak_rate": None, "public_accuracy": None,
            "seconds_per_answer": None, "n_questions": 0, "note": why}


# =========================================================================== rows
@dataclass(frozen=True)
class Server:
    """How to start one server: its command (``--host``/``--port`` are appended) and environment
    changes. Rows whose servers are equal share one server."""

    cmd: tuple[str, ...]
    env: tuple[tuple[str, str | None], ...] = ()  # (name, value); None removes the variable
    dp: bool = False  # has /v1/dp/budget


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    expected_prompt_tokens: int
    extra: dict = field(default_factory=dict)  # more request fields (vllm_xargs)
    messages: list[dict] | None = None  # a chat request (/v1/chat/completions) instead of the prompt


@dataclass(frozen=True)
class Row:
    """One way of serving the context. ``server(bench, eps, scenarios)`` -> Server for those
    scenarios; ``request(layout, scenario, question)`` -> Request. ``private`` rows run once per
    eps."""

    help: str
    private: bool
    server: Callable[[Bench, float | None, Sequence[dict]], Server]  # (bench, eps, its scenarios)
    request: Callable[[ChatLayout, dict, dict], Request]
    contexts_per_server: int | None = None  # split the scenarios over servers of at most this many contexts
    sheets: bool = False  # request(layout, scenario, question, the scenario's released sheet text)


def stock_server(bench: Bench, eps: float | None, scenarios: Sequence[dict]) -> Server:
    return Server(cmd=(*LAUNCH, "serve", bench.model, *bench.engine_flags()), env=(("VLLM_PLUGINS", ""),))


def dp_server(mode: str, **attention: object) -> Callable[[Bench, float | None, Sequence[dict]], Server]:
    """``vllm-dp serve`` with each of ``scenarios``' documents as a named private context (under
    ``unit: document`` their collection files, laid out by the server)."""
    documents = attention.get("unit") == "document"

    def server(bench: Bench, eps: float | None, scenarios: Sequence[dict]) -> Server:
        assert eps is not None
        settings = "".join(f"-{k}={v}" for k, v in sorted(attention.items()))  # rows of one mode differ here
        name = f"{mode}-eps{eps:g}{settings}-{scenarios[0]['id']}"
        files = bench.collection_files(scenarios) if documents else bench.context_files(scenarios)
        section = {
            "key_file": str(bench.work / "noise.key"),
            "ledger_file": str(bench.work / f"ledger-{name}.jsonl"),  # one per row: every rerun allowed
            "attention": {"mode": mode, "epsilon": eps, "delta": DELTA,
                          "composition": "pld" if eps <= MAX_CURVE_EPS else "basic",
                          "calibration": str(bench.calibration()), "contexts": files, **attention},
        }
        config = bench.work / f"dp-{name}.json"
        config.write_text(json.dumps({"dp_privacy": section}, indent=1))
        return Server(cmd=(*VLLM_DP, "serve", bench.model, "--dp-config", str(config), "--tokenizer-mode",
                           "dp_private", *bench.engine_flags()), env=(("VLLM_PLUGINS", None),), dp=True)

    return server


def aggregate_server(mechanism: str, **settings: object) -> Callable[[Bench, float | None, Sequence[dict]], Server]:
    """``vllm-dp serve`` with DP aggregation (``dp_privacy.aggregate``), each of ``scenarios``'
    documents a collection (one document per line) named by the scenario id; ``settings``:
    more ``aggregate`` keys (default: the recommended settings, docs/aggregation.md)."""

    def server(bench: Bench, eps: float | None, scenarios: Sequence[dict]) -> Server:
        assert eps is not None
        name = f"aggregate-{mechanism}-eps{eps:g}-{scenarios[0]['id']}"
        section = {
            "key_file": str(bench.work / "noise.key"),
            "aggregate": {"mechanism": mechanism, "epsilon": eps, "delta": DELTA,
                          "total_epsilon": 100 * eps,  # every question of a scenario fits
                          "contexts": bench.collection_files(scenarios),
                          "budget_file": str(bench.work / f"queries-{name}.jsonl"), **settings},
        }
        config = bench.work / f"dp-{name}.json"
        config.write_text(json.dumps({"dp_privacy": section}, indent=1))
        return Server(cmd=(*VLLM_DP, "serve", bench.model, "--dp-config", str(config), *bench.engine_flags()),
                      env=(("VLLM_PLUGINS", None),), dp=True)

    return server


def fact_sheet_server(bench: Bench, eps: float | None, scenarios: Sequence[dict]) -> Server:
    """``vllm-dp serve`` with a DP fact sheet (``dp_privacy.fact_sheet``) per scenario, released
    once at eps per collection (each row its own ledger; a rerun is the same keyed release)."""
    assert eps is not None
    name = f"fact-sheet-eps{eps:g}-{scenarios[0]['id']}"
    section = {
        "key_file": str(bench.work / "noise.key"),
        "ledger_file": str(bench.work / f"ledger-{name}.jsonl"),
        "fact_sheet": {"epsilon": eps, "delta": DELTA, "contexts": bench.collection_files(scenarios)},
    }
    config = bench.work / f"dp-{name}.json"
    config.write_text(json.dumps({"dp_privacy": section}, indent=1))
    return Server(cmd=(*VLLM_DP, "serve", bench.model, "--dp-config", str(config), *bench.engine_flags()),
                  env=(("VLLM_PLUGINS", None),), dp=True)


def fact_sheet_request(layout: ChatLayout, scenario: dict, q: dict, sheet: FactSheet | None = None) -> Request:
    """The user turn as a chat request; the server puts the released ``sheet``'s facts about the
    question (``FactSheet.about``) in its system turn, as the ``full`` row's documents."""
    text = None if sheet is None else sheet.about(q["q"]).system_text()
    request = chat_request(layout, scenario, q, text)
    return Request(request.prompt, request.expected_prompt_tokens, {"vllm_xargs": {"dp_context": scenario["id"]}},
                   messages=request.messages)


def chat_request(layout: ChatLayout, scenario: dict, q: dict, system: str | None = None) -> Request:
    """The user turn as a chat request; the server renders it with its chat template (``system``:
    the system turn the server adds, if any, for the prompt length it must report)."""
    user = [{"role": "user", "content": q["q"]}]
    served = user if system is None else [{"role": "system", "content": system}, *user]
    ids = list(layout.tokenizer.apply_chat_template(served, tokenize=True, add_generation_prompt=True,
                                                    return_dict=False))
    return Request(ids, len(ids), messages=user)


def sheet_quality(scenarios: Sequence[dict], contexts: Sequence[dict]) -> dict:
    """The released sheets against the scenarios: facts per collection, and the shared facts of
    each support whose answer is on their collection's sheet (recall)."""
    facts = {c["name"]: [f["fact"].lower() for f in c.get("facts", [])] for c in contexts}
    found: dict[str, list[bool]] = {}
    for s in scenarios:
        for q in s["questions"]:
            if q["kind"] == "shared":
                hit = any(a.lower() in f for a in q["answers"] for f in facts.get(s["id"], []))
                found.setdefault(str(q["support"]), []).append(hit)
    return {"facts_per_collection": sum(len(v) for v in facts.values()) / max(1, len(facts)),
            "recall": {k: sum(v) / len(v) for k, v in sorted(found.items(), key=lambda kv: int(kv[0]))}}


def aggregate_request(layout: ChatLayout, scenario: dict, q: dict) -> Request:
    """The user turn alone (the public sequence; members get their documents before it)."""
    prompt = layout.none_ids(scenario["documents"], q["q"])
    return Request(prompt, len(prompt), {"vllm_xargs": {"dp_context": scenario["id"]}})


def _plain(ids: Callable[[ChatLayout, Sequence[str], str], list[int]]):
    def request(layout: ChatLayout, scenario: dict, q: dict) -> Request:
        prompt = ids(layout, scenario["documents"], q["q"])
        return Request(prompt, len(prompt))

    return request


def dp_request(layout: ChatLayout, scenario: dict, q: dict) -> Request:
    return Request(layout.dp_ids(scenario["documents"], q["q"]),
                   len(layout.full_ids(scenario["documents"], q["q"])),
                   {"vllm_xargs": {"dp_context": scenario["id"]}})


def document_request(layout: ChatLayout, scenario: dict, q: dict) -> Request:
    """As ``dp_request``; the server lays the documents out in slots of ``DOCUMENT_TOKENS``."""
    from vllm_dp_plugin.serving.context import document_layout

    context = document_layout(scenario["documents"], layout.tokenizer, DOCUMENT_TOKENS, "bench")
    user = layout.dp_ids(scenario["documents"], q["q"])
    return Request(user, len(context.ids) + len(layout.user_ids(scenario["documents"], q["q"])),
                   {"vllm_xargs": {"dp_context": scenario["id"]}})


ROWS: dict[str, Row] = {
    "none": Row("no context: the user turn alone (stock vLLM)", False, stock_server, _plain(ChatLayout.none_ids)),
    "full": Row("the documents in plain text before the user turn (stock vLLM)", False, stock_server,
                _plain(ChatLayout.full_ids)),
    "none_chat": Row("no context, asked through the chat API (the template's default system turn, if any: the "
                     "baseline of the chat rows, fact_sheet)", False, stock_server, chat_request),
    "dp_state": Row("DP attention, mode state (noisy kernelised state), default settings (public head, gate)",
                    True, dp_server("state"), dp_request),
    "dp_state_head": Row("DP attention, mode state, public head, gate off (every release read)", True,
                         dp_server("state", gate=False), dp_request),
    "dp_state_bare": Row("DP attention, mode state, no public head, gate off (the paper's setting)", True,
                         dp_server("state", public_head=0, gate=False), dp_request),
    "dp_state_doc": Row("DP attention, mode state, unit document (one slot of 64 tokens per document, block "
                        "attention among documents), default settings", True,
                        dp_server("state", unit="document", document_tokens=DOCUMENT_TOKENS), document_request),
    "dp_state_doc_open": Row("DP attention, mode state, unit document, gate off (every release read)", True,
                             dp_server("state", unit="document", document_tokens=DOCUMENT_TOKENS, gate=False),
                             document_request),
    # Taylor degree 1 keeps the path-sum tables small, and still an ~800-token context's release is
    # ~4.7 GB on SmolLM2 (30 layers x 3 KV heads x 65 features x 1024 leaves x 3 moments x 65 columns
    # x 4 bytes): 2 contexts a server.
    "dp_tree": Row("DP attention, mode tree (DPTree; Taylor degree 1 keeps its tables small), default settings",
                   True, dp_server("tree", degree=1), dp_request, contexts_per_server=2),
    "dp_tree_bare": Row("DP attention, mode tree (Taylor degree 1), no public head, gate off (the paper's setting)",
                        True, dp_server("tree", degree=1, public_head=0, gate=False), dp_request,
                        contexts_per_server=2),
    "aggregate_expmech": Row("DP aggregation at the output: exponential mechanism over clipped log-probability "
                             "differences (unit: one document, eps per query)", True,
                             aggregate_server("expmech"), aggregate_request),
    "aggregate_vote": Row("DP aggregation at the output: noisy vote (report-noisy-max) of the members' tokens "
                          "(unit: one document, eps per query)", True, aggregate_server("vote"), aggregate_request),
    "aggregate_answer": Row("DP aggregation once per answer: one member per document answers, one DP partition "
                            "selection releases the fact enough members agree on, the model answers with it (unit: "
                            "one document, eps per query)", True, aggregate_server("answer"), aggregate_request),
    "fact_sheet": Row("DP fact sheet: the facts many documents state, released once per collection (DP set union, "
                      "unit: one document, eps per collection), served as a plain context; queries spend nothing",
                      True, fact_sheet_server, fact_sheet_request, sheets=True),
}


# =========================================================================== running
@dataclass
class Bench:
    model: str
    scenarios: list[dict]
    work: Path
    cache_dir: Path
    max_tokens: int = ANSWER_TOKENS
    concurrency: int = 8
    _calibration: Path | None = None
    _layout: ChatLayout | None = None
    _engine_flags: list[str] | None = None

    def calibration(self) -> Path:
        """The model's public calibration (``vllm-dp calibrate``), cached by weights digest."""
        if self._calibration is None:
            self._calibration = cached_calibration(self.model, self.cache_dir)
        return self._calibration

    def context_files(self, scenarios: Sequence[dict]) -> dict[str, str]:
        """One context file per scenario (its ``C``), named by the scenario id."""
        return self._scenario_files(scenarios, "contexts", ".txt",
                                    lambda s: self.layout().context_text(s["documents"]))

    def collection_files(self, scenarios: Sequence[dict]) -> dict[str, str]:
        """One document collection per scenario (JSONL, one document a line), named by its id."""
        return self._scenario_files(scenarios, "collections", ".jsonl", lambda s: "".join(
            json.dumps({"id": str(i), "text": d}) + "\n" for i, d in enumerate(s["documents"])))

    def _scenario_files(self, scenarios: Sequence[dict], folder: str, suffix: str,
                        render: Callable[[dict], str]) -> dict[str, str]:
        """scenario id -> ``work/folder/<id><suffix>`` holding ``render(scenario)`` (written once)."""
        where = self.work / folder
        where.mkdir(exist_ok=True)
        files = {}
        for s in scenarios:
            path = where / f"{s['id']}{suffix}"
            if not path.exists():
                path.write_text(render(s), encoding="utf-8")
            files[s["id"]] = str(path)
        return files

    @property
    def max_model_len(self) -> int:
        """Every server's ``--max-model-len``: the model's own maximum (a row whose requests need
        more does not fit)."""
        return kv_shape(self.model).max_positions

    def engine_flags(self) -> list[str]:
        """``ENGINE_FLAGS``, ``--max-model-len`` and a KV cache (bytes) for ``concurrency``
        sequences of the longest plain request (documents + question + answer); the same for
        every server, so rows with equal servers share one."""
        if self._engine_flags is None:
            layout = self.layout()
            longest = max(len(layout.full_ids(s["documents"], q["q"])) for s in self.scenarios for q in s["questions"])
            tokens = min(self.max_model_len, longest + self.max_tokens)
            self._engine_flags = [*ENGINE_FLAGS, "--max-model-len", str(self.max_model_len),
                                  *kv_cache_flags(self.model, self.max_model_len, self.concurrency, tokens=tokens)]
        return self._engine_flags

    def misfit(self, row: Row, scenarios: Sequence[dict]) -> str | None:
        """Why ``row`` cannot serve ``scenarios`` (a request longer than ``max_model_len``), or None."""
        layout = self.layout()
        need = max(row.request(layout, s, q).expected_prompt_tokens for s in scenarios for q in s["questions"])
        if need + self.max_tokens <= self.max_model_len:
            return None
        return (f"does not fit: a request needs {need} + {self.max_tokens} tokens, the model holds "
                f"{self.max_model_len}")

    def layout(self) -> ChatLayout:
        if self._layout is None:
            from transformers import AutoTokenizer

            self._layout = ChatLayout(AutoTokenizer.from_pretrained(self.model))
        return self._layout


class RunningServer(vllm_lib.RunningServer):
    """``server`` started on a free local port until /health answers, stopped on exit
    (``benchmarks.lib.vllm.RunningServer``), and asked for completions."""

    def __init__(self, server: Server, log: Path, timeout: float = 900) -> None:
        super().__init__(server.cmd, log, vllm_lib.with_env(server.env), timeout)
        self.server = server

    def complete(self, model: str, request: Request, max_tokens: int) -> dict:
        """The completion's JSON (a chat request's answer as ``choices[0].text``)."""
        chat = request.messages is not None
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, **request.extra,
                **({"messages": request.messages} if chat else {"prompt": request.prompt})}
        route = "/v1/chat/completions" if chat else "/v1/completions"
        req = urllib.request.Request(self.base + route, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=900) as response:
                out = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{route} answered {exc.code}: {exc.read()[:2000]!r}") from None
        if chat:
            out["choices"] = [{"text": c["message"]["content"] or ""} for c in out["choices"]]
        return out


def ask_all(bench: Bench, server: RunningServer, row: Row, scenarios: Sequence[dict], label: str,
            progress=None, unserved: bool = False, sheets: dict | None = None) -> tuple[list[Answer], float]:
    """Every question of ``scenarios``, ``bench.concurrency`` in flight; (answers, wall s).
    ``unserved``: the server serves no context (every one out of regime), so it sees the
    request's own tokens only; ``sheets``: scenario id -> its released fact sheet's text."""
    layout = bench.layout()
    jobs = [(s, q, row.request(layout, s, q, *([sheets.get(s["id"])] if row.sheets else [])))
            for s in scenarios for q in s["questions"]]

    def one(job) -> Answer:
        s, q, request = job
        out = server.complete(bench.model, request, bench.max_tokens)
        got = out["usage"]["prompt_tokens"]
        expected = len(request.prompt) if unserved else request.expected_prompt_tokens
        if got != expected:
            raise RuntimeError(f"{label}: scenario {s['id']} question {q['q']!r}: the server saw {got} prompt "
                               f"tokens, the layout expects {expected}")
        text = out["choices"][0]["text"]
        if progress is not None:
            progress.update(1)
        return Answer(s["id"], q["kind"], q["support"], is_correct(text, q["answers"]), text, got)

    start = time.perf_counter()
    with ThreadPoolExecutor(bench.concurrency) as pool:
        answers = list(pool.map(one, jobs))
    return answers, time.perf_counter() - start


def server_parts(row: Row, scenarios: Sequence[dict]) -> list[list[dict]]:
    """``scenarios`` in consecutive parts of at most ``row.contexts_per_server`` (one server each)."""
    size = row.contexts_per_server or max(1, len(scenarios))
    return [list(scenarios[i:i + size]) for i in range(0, len(scenarios), size)]


def jobs_of(rows: Sequence[str], eps: Sequence[float]) -> list[tuple[str, float | None]]:
    """(row, eps) pairs in order: non-private rows once, private rows at every eps."""
    out = []
    for name in rows:
        if name not in ROWS:
            raise SystemExit(f"unknown row {name!r}; known rows: {', '.join(ROWS)}")
        out += [(name, e) for e in eps] if ROWS[name].private else [(name, None)]
    return out


def _serve(up: contextlib.ExitStack, running: RunningServer | None, spec: Server, log: Path) -> RunningServer:
    """``running`` if it runs ``spec`` (rows with the same server share it), else a new server for
    ``spec`` on ``up`` after stopping the old one."""
    if running is not None and running.server == spec:
        return running
    up.close()
    return up.enter_context(RunningServer(spec, log))


def run(bench: Bench, rows: Sequence[str], eps: Sequence[float], log=None,
        after_row=None) -> tuple[list[dict], list[dict], list[dict]]:
    """Measure every (row, eps); returns (result rows, budget statements, sample answers of the
    first two scenarios), also handed to ``after_row`` after each row."""
    from tqdm import tqdm

    log = log or tqdm.write
    jobs = jobs_of(rows, eps)
    n_questions = sum(len(s["questions"]) for s in bench.scenarios)
    first = {s["id"] for s in bench.scenarios[:2]}
    results, budgets, samples = [], [], []
    server: RunningServer | None = None
    with contextlib.ExitStack() as up, tqdm(total=len(jobs), desc="rows", unit="row", position=0) as bar:
        for name, e in jobs:
            row, label = ROWS[name], name if e is None else f"{name} eps={e:g}"
            answers, seconds, contexts = [], 0.0, []
            misfit = bench.misfit(row, bench.scenarios)
            if misfit is not None:
                results.append(unfit(name, e, misfit))
                log(f"vllm-dp bench context: {describe(results[-1])}")
                if after_row is not None:
                    after_row(results, budgets, samples)
                bar.update(1)
                continue
            with tqdm(total=n_questions, desc=label, unit="q", position=1, leave=False) as qbar:
                for part in server_parts(row, bench.scenarios):
                    tag = label.replace(" eps=", "@") + f"-{part[0]['id']}"
                    server = _serve(up, server, row.server(bench, e, part), bench.work / f"server-{tag}.log")
                    payload = server.get("/v1/dp/budget") if server.server.dp else {"contexts": []}
                    if payload["contexts"] and not answers:  # the statement of the row's first context
                        budgets.append({"row": name, "eps": e, **payload["contexts"][0]})
                    unserved = bool(payload["contexts"]) and all(c.get("releases") == 0 for c in payload["contexts"])
                    sheets = {c["name"]: FactSheet.from_json(c["facts"]) for c in payload["contexts"] if "facts" in c}
                    contexts += payload["contexts"]
                    got, wall = ask_all(bench, server, row, part, label, qbar, unserved, sheets)
                    answers, seconds = answers + got, seconds + wall
            result = summarize(name, e, answers, seconds)
            if row.sheets:
                result["sheet"] = sheet_quality(bench.scenarios, contexts)
            results.append(result)
            samples += [{"row": name, "eps": e, "scenario": a.scenario, "kind": a.kind,
                         "support": a.support, "correct": a.correct, "text": a.text}
                        for a in answers if a.scenario in first]
            log(f"vllm-dp bench context: {describe(result)}")
            if after_row is not None:  # the report so far: a stopped run keeps its rows
                after_row(results, budgets, samples)
            bar.update(1)
    return results, budgets, samples


# =========================================================================== speed
SPEED_MEMBERS = (4, 8, 16)
SPEED_QUESTIONS = 6  # answered one at a time per setting (the first scenarios' questions)


def speed(bench: Bench, members: Sequence[int], eps: float, mechanism: str = "vote", log=print) -> list[dict]:
    """Time per output token, one request at a time (batch of 1): a stock request with the full
    context as plain prompt (``ignore_eos``, ``bench.max_tokens`` tokens), then an aggregated
    request (``mechanism`` at ``eps``) for each k in ``members``; then the aggregated throughput
    with ``bench.concurrency`` requests in flight at the middle k."""
    layout = bench.layout()
    jobs = [(s, q) for s in bench.scenarios for q in s["questions"]][:SPEED_QUESTIONS]
    rows = []

    def timed(server, make, extra, concurrency=1):
        def one(job):
            request = make(layout, *job)
            body = Request(request.prompt, request.expected_prompt_tokens, {**request.extra, **extra})
            return server.complete(bench.model, body, bench.max_tokens)["usage"]["completion_tokens"]

        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            tokens = sum(pool.map(one, jobs if concurrency == 1 else jobs * 2))
        return time.perf_counter() - start, tokens

    with RunningServer(stock_server(bench, None, bench.scenarios), bench.work / "speed-stock.log") as server:
        timed(server, _plain(ChatLayout.full_ids), {"ignore_eos": True})  # warm-up
        wall, tokens = timed(server, _plain(ChatLayout.full_ids), {"ignore_eos": True})
    stock = wall / tokens
    rows.append({"setting": "stock, full context as plain prompt", "members": None, "concurrency": 1,
                 "s_per_token": stock, "ratio_to_stock": 1.0, "tokens": tokens})
    log(f"vllm-dp bench context --speed: stock {1000 * stock:.0f} ms/token")
    middle = sorted(members)[len(members) // 2]
    for k in members:
        spec = aggregate_server(mechanism, members=k)(bench, eps, bench.scenarios)
        with RunningServer(spec, bench.work / f"speed-k{k}.log") as server:
            timed(server, aggregate_request, {})  # warm-up: the members' prefixes enter the cache
            wall, tokens = timed(server, aggregate_request, {})
            rows.append({"setting": f"aggregate_{mechanism}, k = {k}", "members": k, "concurrency": 1,
                         "s_per_token": wall / tokens, "ratio_to_stock": wall / tokens / stock, "tokens": tokens})
            log(f"vllm-dp bench context --speed: k={k} {1000 * wall / tokens:.0f} ms/token "
                f"({wall / tokens / stock:.2f}x stock)")
            if k == middle:
                wall, tokens = timed(server, aggregate_request, {}, bench.concurrency)
                rows.append({"setting": f"aggregate_{mechanism}, k = {k}, {bench.concurrency} in flight",
                             "members": k, "concurrency": bench.concurrency, "s_per_token": wall / tokens,
                             "ratio_to_stock": wall / tokens / stock, "tokens": tokens,
                             "tokens_per_s": tokens / wall})
    return rows


ANSWER_DOCUMENTS = (21, 50, 200)  # --speed --rows aggregate_answer: collection sizes
ANSWER_SPEED_SEED = 7  # their scenarios (generated, not the bundled ones)


def answer_speed(model: str, work: Path, cache_dir: Path, counts: Sequence[int], eps: float, max_tokens: int,
                 log=print) -> list[dict]:
    """Seconds per answer, one request at a time, of ``full`` and ``aggregate_answer`` at ``eps``
    over one generated scenario of each document count in ``counts`` (its 7 questions after a
    warm-up question that fills the prefix cache): how the members' batch grows with the collection."""
    rows = []
    for n in counts:
        scenario = make_scenario(random.Random(ANSWER_SPEED_SEED), 0, extra_docs=n - max(SUPPORTS))
        bench = Bench(model, [scenario], work / f"docs{n}", cache_dir, max_tokens, concurrency=1)
        bench.work.mkdir(exist_ok=True)
        for name, e in (("full", None), ("aggregate_answer", eps)):
            row = ROWS[name]
            why = bench.misfit(row, [scenario])
            if why is not None:
                rows.append({"documents": n, "row": name, "eps": e, "s_per_answer": None, "note": why})
                continue
            with RunningServer(row.server(bench, e, [scenario]), bench.work / f"speed-{name}.log") as server:
                ask_all(bench, server, row, [{**scenario, "questions": scenario["questions"][:1]}], name)  # warm-up
                answers, wall = ask_all(bench, server, row, [scenario], name)
            rows.append({"documents": n, "row": name, "eps": e, "s_per_answer": wall / len(answers),
                         "correct": sum(a.correct for a in answers), "questions": len(answers)})
            log(f"vllm-dp bench context --speed: {n} documents, {name}: {wall / len(answers):.2f} s/answer")
    return rows


def answer_speed_markdown(data: dict) -> str:
    lines = [f"# Answer-level aggregation speed ({data['model']}, {data['device']}, {data['date']})", "",
             (f"`{data['command']}`; one generated scenario (seed {ANSWER_SPEED_SEED}) per collection size, its "
              f"questions one at a time after a warm-up question; `aggregate_answer` at eps = {data['eps']:g} per query "
              "(one member per document)."), "",
             "| documents | row | s / answer | x full | correct |", "|---|---|---|---|---|"]
    full = {r["documents"]: r["s_per_answer"] for r in data["rows"] if r["row"] == "full"}
    for r in data["rows"]:
        if r["s_per_answer"] is None:
            lines.append(f"| {r['documents']} | {r['row']} | {r['note']} | | |")
            continue
        ratio = f"{r['s_per_answer'] / full[r['documents']]:.1f}" if full.get(r["documents"]) else ""
        lines.append(f"| {r['documents']} | {r['row']} | {r['s_per_answer']:.2f} | {ratio} | "
                     f"{r['correct']} of {r['questions']} |")
    return "\n".join(lines) + "\n"


def speed_markdown(data: dict) -> str:
    lines = [f"# DP aggregation speed ({data['model']}, {data['device']}, {data['date']})", "",
             (f"`{data['command']}`; eps = {data['eps']:g} per query, mechanism {data['mechanism']}; time per "
             "output token = wall time of a request / its output tokens (prefill included), requests one at a "
             f"time unless stated; {SPEED_QUESTIONS} questions per setting after a warm-up pass."), "",
             "| setting | s / token | x stock | tokens | tokens / s |", "|---|---|---|---|---|"]
    for r in data["rows"]:
        tps = f"{r['tokens_per_s']:.1f}" if "tokens_per_s" in r else ""
        lines.append(f"| {r['setting']} | {r['s_per_token']:.3f} | {r['ratio_to_stock']:.2f} | {r['tokens']} | {tps} |")
    return "\n".join(lines) + "\n"


def describe(r: dict) -> str:
    eps = "" if r["eps"] is None else f" eps={r['eps']:g}"
    if r.get("note"):
        return f"{r['row']}{eps}: {r['note']}"
    shared = ", ".join(f"s{k} {v:.2f}" for k, v in r["shared_accuracy"].items())
    return (f"{r['row']}{eps}: shared [{shared}] secret leak {r['secret_leak_rate']:.2f} public "
            f"{r['public_accuracy']:.2f} ({r['seconds_per_answer']:.3f} s/answer, {r['n_questions']} questions)")


# =========================================================================== report
def markdown(data: dict) -> str:
    supports = sorted({int(k) for r in data["rows"] for k in r["shared_accuracy"]})
    counts = data["question_counts"]
    commands = " then ".join(f"`{c}`" for c in [*data.get("earlier_commands", []), data["command"]])
    lines = [f"# vllm-dp bench context ({data['device']}, {data['date']})", "",
             (f"Command: {commands}. Model: `{data['model']}`. Scenarios: `{data['scenarios']}` "
             f"({data['n_scenarios']} scenarios: {counts['shared']} shared-fact, {counts['secret']} secret and "
             f"{counts['public']} public questions; a row with fewer questions answered the first scenarios "
             f"only, `--limit`). Greedy, {data['max_tokens']} tokens; an answer "
             "is correct when one of its answers occurs in the completion (case-insensitive). "
             "`none`: no context; `full`: the documents as plain text (exact attention); `dp_*`: the "
             "documents as the private context (DP attention), eps for the whole model per context, "
             f"delta = {DELTA:g}; eps = 1e7 leaves the kernel error alone; `aggregate_*`: DP aggregation "
             "at the output over the documents as a collection (unit: one document), eps per query; "
             "`fact_sheet`: a DP fact sheet released once per collection (unit: one document, eps per "
             "collection), asked through the chat API. "
             "Seconds per answer: wall "
             f"time of the row's requests ({data['concurrency']} in flight) / questions, server start "
             "excluded."), "",
             "| row | eps | " + " | ".join(f"shared, support {s}" for s in supports)
             + " | secret leak rate | public accuracy | s / answer | questions |",
             "|---|---|" + "---|" * len(supports) + "---|---|---|---|"]
    for r in data["rows"]:
        eps = "" if r["eps"] is None else f"{r['eps']:g}"
        shared = " | ".join(_pct(r["shared_accuracy"].get(str(s))) for s in supports)
        if r.get("note"):
            lines.append(f"| {r['row']} | {eps} | {r['note']} |" + " |" * (len(supports) + 3) + " 0 |")
            continue
        lines.append(f"| {r['row']} | {eps} | {shared} | {_pct(r['secret_leak_rate'])} | "
                     f"{_pct(r['public_accuracy'])} | {r['seconds_per_answer']:.3f} | {r['n_questions']} |")
    sheets = [r for r in data["rows"] if r.get("sheet")]
    if sheets:
        recall = sorted({k for r in sheets for k in r["sheet"]["recall"]}, key=int)
        lines += ["", ("Fact sheets (`fact_sheet` rows): facts released per collection, and the shared facts whose "
                       "answer is on their collection's sheet (recall), by support:"), "",
                  "| row | eps | facts per collection | " + " | ".join(f"recall, support {k}" for k in recall) + " |",
                  "|---|---|---|" + "---|" * len(recall)]
        for r in sheets:
            lines.append(f"| {r['row']} | {r['eps']:g} | {r['sheet']['facts_per_collection']:.2f} | "
                         + " | ".join(_pct(r["sheet"]["recall"].get(k)) for k in recall) + " |")
    if data.get("budgets"):
        lines += ["", "DP budget statements (`GET /v1/dp/budget`, first context):", "",
                  "| row | eps | context tokens | spent eps | guaranteed kernel error per layer | logit bound T (max) |",
                  "|---|---|---|---|---|---|"]
        for b in data["budgets"]:
            if b.get("mode") == "aggregate":
                per = b["per_query"]["worst_case"]
                lines.append(f"| {b['row']} | {b['eps']:g} | (per query, unit one document) | {per['epsilon']:g} "
                             f"| - | - |")
                continue
            if b.get("mode") == "fact_sheet":
                lines.append(f"| {b['row']} | {b['eps']:g} | (once per collection, unit one document) | "
                             f"{b['release']['epsilon']:g} | - | - |")
                continue
            kernel = b.get("kernel_error") or []
            logit = b.get("logit_bound") or []
            spent = (b.get("spent") or {}).get("epsilon")
            lines.append(f"| {b['row']} | {b['eps']:g} | {b.get('context_tokens', '')} | "
                         f"{'' if spent is None else f'{spent:g}'} | "
                         f"{_span(kernel)} | "
                         f"{f'{max(logit):.3g}' if logit else ''} |")
    return "\n".join(lines) + "\n"


def _span(values: Sequence[float | None]) -> str:
    """min-max of per-layer values; a None (no guarantee: out of the Taylor regime) shows as such."""
    if not values:
        return ""
    known = [v for v in values if v is not None]
    none = len(values) - len(known)
    span = f"{min(known):.3g}-{max(known):.3g}" if known else ""
    return span + (f"{'; ' if span else ''}unbounded in {none} of {len(values)} layers" if none else "")


def _pct(x: float | None) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def plot(data: dict, path: Path) -> None:
    """Shared-fact accuracy (all supports), public accuracy and secret leak rate vs eps: one curve
    per DP mechanism, ``none``/``full`` as horizontal lines."""
    plt = pyplot()

    def shared(r):
        n = data["question_counts_by_support"]
        total = sum(n.get(k, 0) for k in r["shared_accuracy"])
        return sum(v * n.get(k, 0) for k, v in r["shared_accuracy"].items()) / total if total else float("nan")

    panels = (("shared-fact accuracy (all supports)", shared), ("public accuracy", lambda r: r["public_accuracy"]),
              ("secret leak rate", lambda r: r["secret_leak_rate"]))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    rows = [r for r in data["rows"] if not r.get("note")]  # rows that ran
    private = [n for n in dict.fromkeys(r["row"] for r in rows) if ROWS.get(n) and ROWS[n].private]
    for ax, (title, value) in zip(axes, panels, strict=True):
        for i, r in enumerate(r for r in rows if r["eps"] is None):
            ax.axhline(value(r), color=f"C{7 + i}", ls="--", lw=1, label=r["row"])
        for i, name in enumerate(private):
            pts = sorted((r["eps"], value(r)) for r in rows if r["row"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}", label=name)
        ax.set_xscale("log")
        if not private:
            ax.set_xlim(0.5, 3 * KERNEL_ONLY_EPS)
        ax.set_xlabel("eps (whole model, per context; 1e7: kernel error alone)")
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"vllm-dp bench context: {Path(data['model']).name}, {data['device']}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# =========================================================================== CLI
def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"Hugging Face model directory (default {DEFAULT_MODEL}, built with "
                             f"`vllm-dp import-model {DEFAULT_MODEL_NAME}` when missing)")
    parser.add_argument("--scenarios", type=Path, default=DEFAULT_SCENARIOS,
                        help="scenarios JSONL (default: the bundled 24 scenarios)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows of {', '.join(ROWS)}")
    parser.add_argument("--eps", default=",".join(f"{e:g}" for e in DEFAULT_EPS),
                        help=f"eps of the DP rows, comma-separated (eps = {KERNEL_ONLY_EPS:g} is always added)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 scenarios, eps 8 only (no 1e7), 8 answer tokens")
    parser.add_argument("--limit", type=int, metavar="N",
                        help="the first N scenarios only (a row's questions column says how many it answered)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result directory")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows (and budget statements) of an existing result file of the same name "
                             "that this run does not measure")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the calibration is cached")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--speed", action="store_true",
                        help="measure time per output token instead: stock (full context as plain prompt) vs "
                             f"aggregate_vote at k = {', '.join(map(str, SPEED_MEMBERS))} (first --eps), one request "
                             "at a time, and throughput at --concurrency; with --rows aggregate_answer: seconds per "
                             f"answer of full and aggregate_answer over {', '.join(map(str, ANSWER_DOCUMENTS))} "
                             "documents")
    parser.add_argument("--make-scenarios", type=Path, metavar="OUT",
                        help="write --count generated scenarios (seed --seed) to OUT and exit")
    parser.add_argument("--count", type=int, default=24, help="scenarios to generate (--make-scenarios)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (--make-scenarios)")
    return parser


def build_parser(prog: str = "vllm-dp bench context") -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))


def kept_rows(path: Path | None, model: str, scenarios: str, max_tokens: int,
              jobs: Sequence[tuple[str, float | None]]) -> dict:
    """``--append``: what an earlier result file at ``path`` keeps (its rows, budget statements and
    sample answers that ``jobs`` does not re-measure, and its commands); it must be of the same
    model, scenarios file and answer length (``--limit`` may differ: rows state their questions)."""
    if path is None or not path.exists():
        return {"rows": [], "budgets": [], "sample_answers": [], "commands": []}
    old = json.loads(path.read_text())
    same = {"model": model, "scenarios": scenarios, "max_tokens": max_tokens}
    if any(old.get(k) != v for k, v in same.items()):
        raise SystemExit(f"--append: {path} was measured with "
                         f"{ {k: old.get(k) for k in same} }, this run with {same}; choose another --out")
    again = set(jobs)

    def keep(item):
        return (item["row"], item["eps"]) not in again

    return {"rows": [r for r in old["rows"] if keep(r)], "budgets": [b for b in old.get("budgets", []) if keep(b)],
            "sample_answers": [a for a in old.get("sample_answers", []) if keep(a)],
            "commands": [*old.get("earlier_commands", []), old["command"]]}


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``args``: parsed arguments (``add_cli_args``) or an argv list (``vllm-dp bench context ...``)."""
    args, argv = parse(args, build_parser)
    if args.make_scenarios is not None:
        path = write_scenarios(make_scenarios(args.count, args.seed), args.make_scenarios)
        print(f"{args.count} scenarios (seed {args.seed}) written to {path}")
        return 0
    rows = [r for r in args.rows.split(",") if r]
    eps = [float(e) for e in args.eps.split(",") if e]
    every = load_scenarios(args.scenarios)  # the file's: the report's header describes them all
    scenarios = every[:args.limit]
    max_tokens = ANSWER_TOKENS
    if args.quick:
        scenarios, eps, max_tokens = scenarios[:2], [8.0], 8
    elif KERNEL_ONLY_EPS not in eps:
        eps.append(KERNEL_ONLY_EPS)
    jobs_of(rows, eps)  # unknown rows fail before anything starts
    model = ensure_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-dp-bench-context-"))
    bench = Bench(model, scenarios, work, args.cache_dir, max_tokens, args.concurrency)
    started = time.perf_counter()
    date = today()
    device = device_label(default_device())  # the device vLLM serves on
    command = "vllm-dp bench context" + ("" if argv is None else " " + " ".join(argv))
    if args.speed:
        answer = rows == ["aggregate_answer"]
        measured = (answer_speed(model, work, args.cache_dir, ANSWER_DOCUMENTS, eps[0], max_tokens) if answer
                    else speed(bench, SPEED_MEMBERS, eps[0]))
        data = {"model": model, "device": device, "date": date, "command": command.strip(), "eps": eps[0],
                "mechanism": "answer" if answer else "vote", "rows": measured,
                "platform": platform.platform(), "wall_s": time.perf_counter() - started}
        stem = args.out / f"context-{'answer-' if answer else ''}speed-{device}-{date}"
        write_json(suffixed(stem, ".json"), data, indent=1)
        write_text(suffixed(stem, ".md"), (answer_speed_markdown if answer else speed_markdown)(data))
        print(suffixed(stem, ".md").read_text())
        shutil.rmtree(work, ignore_errors=True)
        return 0
    questions = [q for s in every for q in s["questions"]]
    by_support = {}
    for q in questions:
        if q["kind"] == "shared":
            by_support[str(q["support"])] = by_support.get(str(q["support"]), 0) + 1
    stem = args.out / f"context-{device}-{date}"

    kept = kept_rows(suffixed(stem, ".json") if args.append else None, model, _shown(args.scenarios), max_tokens,
                     jobs_of(rows, eps))

    def write(results, budgets, samples) -> None:
        data = {"model": model, "device": device, "date": date, "scenarios": _shown(args.scenarios),
                "rows": kept["rows"] + results,
                "command": command.strip(), "earlier_commands": kept["commands"],
                "platform": platform.platform(), "n_scenarios": len(every),
                "question_counts": {k: sum(q["kind"] == k for q in questions) for k in KINDS},
                "question_counts_by_support": by_support, "max_tokens": max_tokens,
                "concurrency": args.concurrency, "budgets": kept["budgets"] + budgets,
                "sample_answers": kept["sample_answers"] + samples,
                "wall_s": time.perf_counter() - started}
        write_json(suffixed(stem, ".json"), data, indent=1)
        write_text(suffixed(stem, ".md"), markdown(data))
        plot(data, suffixed(stem, ".png"))

    try:
        run(bench, rows, eps, after_row=write)
    except BaseException:
        print(f"vllm-dp bench context: logs kept in {work}", file=sys.stderr)
        raise
    print(suffixed(stem, ".md").read_text())
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
