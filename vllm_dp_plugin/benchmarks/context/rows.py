"""The rows of ``vllm-dp bench context`` (``ROWS``): per way of serving, the server it needs
(``Server``) and each question's request (``Request``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from vllm_dp_plugin.aggregate.facts import FactSheet
from vllm_dp_plugin.benchmarks.lib.scenarios import ChatLayout
from vllm_dp_plugin.benchmarks.lib.vllm import LAUNCH, VLLM_DP


class Bench(Protocol):
    """What a row's server needs of the run (``running.Bench``): its model, work directory,
    engine flags, calibration and the scenarios' files."""

    model: str
    work: Path

    def engine_flags(self) -> list[str]: ...

    def calibration(self) -> Path: ...

    def context_files(self, scenarios: Sequence[dict]) -> dict[str, str]: ...

    def collection_files(self, scenarios: Sequence[dict]) -> dict[str, str]: ...


DOCUMENT_TOKENS = 128  # unit document rows: the bundled scenarios' longest document is 85 SmolLM2 tokens
# (95 over seeds 0-39; the simple set's 53)
MAX_CURVE_EPS = 100.0  # pld accounting refuses larger eps (config.MAX_CURVE_EPSILON)
DELTA = 1e-6


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
    plain_documents: bool = False  # the prompt holds the documents in plain text (scoring: a specific of them is supported)


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
            "ledger": str(bench.work / f"ledger-{name}.sqlite"),  # one per row: every rerun allowed
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
        variant = "".join(f"-{k}-{v}" for k, v in sorted(settings.items()))
        name = f"aggregate-{mechanism}{variant}-eps{eps:g}-{scenarios[0]['id']}"
        section = {
            "key_file": str(bench.work / "noise.key"),
            "aggregate": {"mechanism": mechanism, "epsilon": eps, "delta": DELTA,
                          "total_epsilon": 100 * eps,  # every question of a scenario fits
                          "contexts": bench.collection_files(scenarios),
                          # every question its own release: the bench measures the mechanism, not reuse
                          **({"reuse_answers": False} if mechanism == "answer" else {}),
                          **settings},
            "ledger": str(bench.work / f"ledger-{name}.sqlite"),
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
        "ledger": str(bench.work / f"ledger-{name}.sqlite"),
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
                _plain(ChatLayout.full_ids), plain_documents=True),
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
    "aggregate_answer_batch": Row("as aggregate_answer, but each query runs exactly 16 members, those whose "
                                  "document can answer the question (answer_batch: 16; l0 = 2: threshold 9 at eps 4)",
                                  True, aggregate_server("answer", answer_batch=16), aggregate_request),
    "aggregate_extract": Row("as aggregate_answer, but no model runs for a member: each reads its document by rule "
                             "(answer_member: extract) and votes for the phrase of its clause that answers",
                             True, aggregate_server("answer", answer_member="extract"), aggregate_request),
    "fact_sheet": Row("DP fact sheet: the facts many documents state, released once per collection (DP set union, "
                      "unit: one document, eps per collection), served as a plain context; queries spend nothing",
                      True, fact_sheet_server, fact_sheet_request, sheets=True),
}
