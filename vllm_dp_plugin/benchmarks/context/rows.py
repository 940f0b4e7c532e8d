"""The rows of ``vllm-dp bench context`` (``ROWS``): per way of serving, the server it needs
(``Server``) and each question's request (``Request``), made from the run's state (``Bench``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib import vllm as vllm_lib
from vllm_dp_plugin.benchmarks.lib.scenarios import ANSWER_TOKENS, ChatLayout, cached_calibration
from vllm_dp_plugin.serving.memory import kv_shape

DOCUMENT_TOKENS = 128  # unit document rows: the longest bundled document is 85 SmolLM2 tokens (95 over seeds 0-39)
MAX_CURVE_EPS = 100.0  # pld accounting refuses larger eps (config.MAX_CURVE_EPSILON)
DELTA = 1e-6


@dataclass(frozen=True)
class Server:
    """How to start a server: its command (less ``--host``/``--port``) and environment changes."""

    cmd: tuple[str, ...]
    env: tuple[tuple[str, str | None], ...] = ()  # (name, value); None removes the variable
    dp: bool = False  # has /v1/dp/budget


@dataclass(frozen=True)
class Request:
    """One question's request and the prompt length the server must report."""

    prompt: list[int]
    expected_prompt_tokens: int
    extra: dict = field(default_factory=dict)  # more request fields (vllm_xargs)
    messages: list[dict] | None = None  # a chat request (/v1/chat/completions) instead of the prompt


@dataclass(frozen=True)
class Row:
    """One way of serving: ``server`` and ``request(layout, scenario, question)``; private: per eps."""

    private: bool
    server: Callable[[Bench, float | None, Sequence[dict]], Server]  # (bench, eps, its scenarios)
    request: Callable[..., Request]
    contexts_per_server: int | None = None  # split the scenarios over servers of at most this many contexts
    sheets: bool = False  # request(layout, scenario, question, the scenario's released sheet text)
    plain_documents: bool = False  # the prompt holds the documents in plain text (their specifics are supported)


@dataclass
class Bench:
    """The run's state, what every row's servers and requests are made of."""

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
        """scenario id -> its context file (its ``C``)."""
        return self._files(scenarios, "contexts", ".txt", lambda s: self.layout().context_text(s["documents"]))

    def collection_files(self, scenarios: Sequence[dict]) -> dict[str, str]:
        """scenario id -> its document collection (JSONL, one document a line)."""
        return self._files(scenarios, "collections", ".jsonl", lambda s: "".join(
            json.dumps({"id": str(i), "text": d}) + "\n" for i, d in enumerate(s["documents"])))

    def _files(self, scenarios: Sequence[dict], folder: str, suffix: str, render: Callable[[dict], str]) -> dict:
        """scenario id -> ``work/folder/<id><suffix>`` holding ``render(scenario)`` (written once)."""
        (self.work / folder).mkdir(exist_ok=True)
        files = {s["id"]: self.work / folder / f"{s['id']}{suffix}" for s in scenarios}
        for s in scenarios:
            if not files[s["id"]].exists():
                files[s["id"]].write_text(render(s), encoding="utf-8")
        return {name: str(path) for name, path in files.items()}

    @property
    def max_model_len(self) -> int:
        """Every server's ``--max-model-len``: the model's own maximum."""
        return kv_shape(self.model).max_positions

    def engine_flags(self) -> list[str]:
        """``lib.vllm.engine_flags`` for ``concurrency`` sequences of the longest plain request (every server)."""
        if self._engine_flags is None:
            layout = self.layout()
            longest = max(len(layout.full_ids(s["documents"], q["q"])) for s in self.scenarios for q in s["questions"])
            tokens = min(self.max_model_len, longest + self.max_tokens)
            self._engine_flags = vllm_lib.engine_flags(self.model, self.concurrency, tokens=tokens,
                                                       max_model_len=self.max_model_len)
        return self._engine_flags

    def misfit(self, row: Row, scenarios: Sequence[dict]) -> str | None:
        """Why ``row`` cannot serve ``scenarios`` (a request longer than ``max_model_len``), or None."""
        need = max(row.request(self.layout(), s, q).expected_prompt_tokens for s in scenarios for q in s["questions"])
        if need + self.max_tokens <= self.max_model_len:
            return None
        return f"does not fit: a request needs {need} + {self.max_tokens} tokens, the model holds {self.max_model_len}"

    def layout(self) -> ChatLayout:
        """The model's chat layout (``ChatLayout``) from its tokenizer."""
        if self._layout is None:
            from transformers import AutoTokenizer

            self._layout = ChatLayout(AutoTokenizer.from_pretrained(self.model))
        return self._layout


def stock_server(bench: Bench, eps: float | None, scenarios: Sequence[dict]) -> Server:
    """``vllm serve`` without plugins: one server for every row that is not private."""
    return Server(cmd=(*vllm_lib.LAUNCH, "serve", bench.model, *bench.engine_flags()), env=(("VLLM_PLUGINS", ""),))


def _dp_serve(bench: Bench, name: str, section: dict, *flags: str) -> Server:
    """``vllm-dp serve`` with the ``dp_privacy`` ``section``, the run's key and a ledger of its own."""
    config = bench.work / f"dp-{name}.json"
    section = {"key_file": str(bench.work / "noise.key"), "ledger": str(bench.work / f"ledger-{name}.sqlite"),
               **section}
    config.write_text(json.dumps({"dp_privacy": section}, indent=1))
    return Server(cmd=(*vllm_lib.VLLM_DP, "serve", bench.model, "--dp-config", str(config), *flags,
                       *bench.engine_flags()), env=(("VLLM_PLUGINS", None),), dp=True)


def dp_server(mode: str, **attention: object) -> Callable[[Bench, float, Sequence[dict]], Server]:
    """``vllm-dp serve`` with each scenario's documents as a named private context (DP attention)."""

    def server(bench: Bench, eps: float, scenarios: Sequence[dict]) -> Server:
        settings = "".join(f"-{k}={v}" for k, v in sorted(attention.items()))  # rows of one mode differ here
        files = (bench.collection_files if attention.get("unit") == "document" else bench.context_files)(scenarios)
        section = {"mode": mode, "epsilon": eps, "delta": DELTA,
                   "composition": "pld" if eps <= MAX_CURVE_EPS else "basic",
                   "calibration": str(bench.calibration()), "contexts": files, **attention}
        return _dp_serve(bench, f"{mode}-eps{eps:g}{settings}-{scenarios[0]['id']}", {"attention": section},
                         "--tokenizer-mode", "dp_private")

    return server


def aggregate_server(mechanism: str, **settings: object) -> Callable[[Bench, float, Sequence[dict]], Server]:
    """``vllm-dp serve`` with DP aggregation over each scenario's collection; ``settings``: more keys."""

    def server(bench: Bench, eps: float, scenarios: Sequence[dict]) -> Server:
        variant = "".join(f"-{k}-{v}" for k, v in sorted(settings.items()))
        section = {"mechanism": mechanism, "epsilon": eps, "delta": DELTA,
                   "total_epsilon": 100 * eps,  # every question of a scenario fits
                   "contexts": bench.collection_files(scenarios),
                   # every question its own release: the bench measures the mechanism, not reuse
                   **({"reuse_answers": False} if mechanism == "answer" else {}), **settings}
        return _dp_serve(bench, f"aggregate-{mechanism}{variant}-eps{eps:g}-{scenarios[0]['id']}",
                         {"aggregate": section})

    return server


def fact_sheet_server(bench: Bench, eps: float, scenarios: Sequence[dict]) -> Server:
    """``vllm-dp serve`` with a DP fact sheet per scenario's collection, released once at eps."""
    return _dp_serve(bench, f"fact-sheet-eps{eps:g}-{scenarios[0]['id']}", {
        "fact_sheet": {"epsilon": eps, "delta": DELTA, "contexts": bench.collection_files(scenarios)}})


def _context(scenario: dict) -> dict:
    """The request field that picks the scenario's context (or collection) on a DP server."""
    return {"vllm_xargs": {"dp_context": scenario["id"]}}


def chat_request(layout: ChatLayout, scenario: dict, q: dict, system: str | None = None) -> Request:
    """The user turn as a chat request (``system``: the system turn the server adds, if any)."""
    user = [{"role": "user", "content": q["q"]}]
    served = user if system is None else [{"role": "system", "content": system}, *user]
    ids = list(layout.tokenizer.apply_chat_template(served, tokenize=True, add_generation_prompt=True,
                                                    return_dict=False))
    return Request(ids, len(ids), messages=user)


def fact_sheet_request(layout: ChatLayout, scenario: dict, q: dict, sheet_text: str | None = None) -> Request:
    """``chat_request`` to the scenario's fact sheet, whose facts about the question the server adds."""
    return replace(chat_request(layout, scenario, q, sheet_text), extra=_context(scenario))


def aggregate_request(layout: ChatLayout, scenario: dict, q: dict) -> Request:
    """The user turn alone (the public sequence; members get their documents before it)."""
    prompt = layout.none_ids(scenario["documents"], q["q"])
    return Request(prompt, len(prompt), _context(scenario))


def _plain(ids: Callable[[ChatLayout, Sequence[str], str], list[int]]) -> Callable[[ChatLayout, dict, dict], Request]:
    """The request whose prompt is ``ids(layout, documents, question)``, as stock vLLM gets it."""

    def request(layout: ChatLayout, scenario: dict, q: dict) -> Request:
        prompt = ids(layout, scenario["documents"], q["q"])
        return Request(prompt, len(prompt))

    return request


def dp_request(layout: ChatLayout, scenario: dict, q: dict) -> Request:
    """The user turn; the server puts the scenario's private context before it (``full``'s length)."""
    return Request(layout.dp_ids(scenario["documents"], q["q"]),
                   len(layout.full_ids(scenario["documents"], q["q"])), _context(scenario))


def document_request(layout: ChatLayout, scenario: dict, q: dict) -> Request:
    """As ``dp_request``; the server lays the documents out in slots of ``DOCUMENT_TOKENS``."""
    from vllm_dp_plugin.serving.context import document_layout

    context = document_layout(scenario["documents"], layout.tokenizer, DOCUMENT_TOKENS, "bench")
    user = layout.dp_ids(scenario["documents"], q["q"])
    return Request(user, len(context.ids) + len(layout.user_ids(scenario["documents"], q["q"])), _context(scenario))


# none / full: no context / the documents in plain text (stock vLLM); none_chat: no context, chat API.
# dp_*: DP attention at default settings (public head auto, gate 0.5); _head: gate off; _bare: no public
# head, gate off (the paper's setting); _doc: unit document (_open: gate off). dp_tree at Taylor degree 1
# still releases ~4.7 GB per ~800-token context on SmolLM2 (30 layers x 3 KV heads x 65 features x 1024
# leaves x 3 moments x 65 columns x 4 bytes): 2 contexts a server. aggregate_*: DP aggregation at the
# output, eps per query (vote, expmech: per token; answer: one release per answer; answer_batch: 16
# members a query; extract: members read their document by rule). fact_sheet: released once per collection.
_UNIT_DOCUMENT = {"unit": "document", "document_tokens": DOCUMENT_TOKENS}
ROWS: dict[str, Row] = {
    "none": Row(False, stock_server, _plain(ChatLayout.none_ids)),
    "full": Row(False, stock_server, _plain(ChatLayout.full_ids), plain_documents=True),
    "none_chat": Row(False, stock_server, chat_request),
    "dp_state": Row(True, dp_server("state"), dp_request),
    "dp_state_head": Row(True, dp_server("state", gate=False), dp_request),
    "dp_state_bare": Row(True, dp_server("state", public_head=0, gate=False), dp_request),
    "dp_state_doc": Row(True, dp_server("state", **_UNIT_DOCUMENT), document_request),
    "dp_state_doc_open": Row(True, dp_server("state", **_UNIT_DOCUMENT, gate=False), document_request),
    "dp_tree": Row(True, dp_server("tree", degree=1), dp_request, contexts_per_server=2),
    "dp_tree_bare": Row(True, dp_server("tree", degree=1, public_head=0, gate=False), dp_request,
                        contexts_per_server=2),
    "aggregate_expmech": Row(True, aggregate_server("expmech"), aggregate_request),
    "aggregate_vote": Row(True, aggregate_server("vote"), aggregate_request),
    "aggregate_answer": Row(True, aggregate_server("answer"), aggregate_request),
    "aggregate_answer_batch": Row(True, aggregate_server("answer", answer_batch=16), aggregate_request),
    "aggregate_extract": Row(True, aggregate_server("answer", answer_member="extract"), aggregate_request),
    "fact_sheet": Row(True, fact_sheet_server, fact_sheet_request, sheets=True),
}
