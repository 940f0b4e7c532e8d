"""Privacy reports of a configuration (``vllm-dp account``).

DP attention: the statement ``GET /v1/dp/budget`` gives (``settings.budget_statement``: one
``ContextPlan.report()`` per private context), computed for the model the configuration will
serve (``account_statement``) and rendered line by line from those reports (``attention_report``):
nothing is computed on another path. DP aggregation: ``aggregate_statement`` (one
``plan.aggregate_report`` per collection, with its query ledger), rendered by ``aggregate_text``.
Prompt privatization: the per-token statement.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from .config import (
    AggregatePrivacyConfig,
    ConfigError,
    DPPrivacyConfig,
    FactSheetPrivacyConfig,
    PromptPrivacyConfig,
)


def account_statement(config: DPPrivacyConfig, model: str | None) -> dict:
    """``settings.budget_statement`` of ``config`` served with ``model`` (a Hugging Face model
    directory, or a name in the local cache): what ``GET /v1/dp/budget`` will answer, less each
    context's keyed label and release ledger (they need the secret noise key). The contexts are
    tokenized with the model's tokenizer, as the server does."""
    from .plan import ModelShape
    from .serving.settings import budget_statement

    if config.aggregate is not None:
        return aggregate_statement(config.aggregate, stored_query_ledger(config))
    if config.fact_sheet is not None:
        return fact_sheet_statement(config.fact_sheet, {})
    if config.attention is None:
        return budget_statement(config, None, {})
    if model is None:
        raise ConfigError(
            "dp_privacy.attention: the guarantee depends on the served model (layers, KV heads, head "
            "size, feature map) and on the private contexts' lengths: pass --model MODEL"
        )
    shape = ModelShape.from_pretrained(model)
    return budget_statement(config, shape, context_lengths(config, shape, model))


def stored_query_ledger(config: DPPrivacyConfig):
    """The deployment's query ledger if its noise key exists (``vllm-dp account`` never creates
    a key), else None."""
    from .privacy.keyed_noise import NoiseKey, default_key_path
    from .privacy.query_ledger import QueryLedger

    key_path = Path(config.key_file) if config.key_file else default_key_path()
    if not key_path.exists():
        return None
    key = NoiseKey(key_path)
    return QueryLedger(key, config.ledger_store(key))


def aggregate_statement(agg: AggregatePrivacyConfig, ledger, shown: Collection[str] | None = None) -> dict:
    """The statement of DP aggregation (``dp_privacy.aggregate``): one ``plan.aggregate_report``
    per collection (the least a query is charged, each client's share), with what its queries
    spent so far when ``ledger`` (a ``QueryLedger``) is given: in all, and per client for the
    clients ``shown`` (None: every client, the operator's view; ``()``: none, the public view).
    ``vllm-dp account`` prints the operator's view; ``GET /v1/dp/budget`` answers each caller
    its view of one shared read (``AggregateService.statement``: ``aggregate_view`` of
    ``aggregate_statuses``)."""
    return aggregate_view(agg, None if ledger is None else aggregate_statuses(agg, ledger), shown)


def aggregate_statuses(agg: AggregatePrivacyConfig, ledger) -> dict:
    """What ``ledger`` (a ``QueryLedger``) recorded for the statement: every collection's status
    and each client's on it (``QueryLedger.statuses``), read in one store transaction."""
    from .privacy.accountant import Budget

    total = Budget(agg.total_epsilon, agg.total_delta)
    return ledger.statuses(list(agg.collection_sources()), total, [c.quota for c in agg.clients.values()])


def aggregate_view(agg: AggregatePrivacyConfig, statuses: dict | None, shown: Collection[str] | None = None) -> dict:
    """``aggregate_statement`` from ``statuses`` (``aggregate_statuses``; None: no ledger). A
    client's ledger is in it only where ``shown`` names the client: what a client spent says how
    much it asked (not the documents), which is the client's and the operator's business, not the
    other clients'. Each collection's own spending stays in every view: a 429 states what is left
    of it anyway (or of the client's share, when less)."""
    from .plan import aggregate_report

    def report(name: str) -> dict:
        if statuses is None:
            return aggregate_report(agg, name, None)
        clients = {c: statuses[name, c] for c in agg.clients if shown is None or c in shown}
        return aggregate_report(agg, name, statuses[name, None], clients)

    return {"enabled": True, "mode": "aggregate", "contexts": [report(name) for name in agg.collection_sources()],
            "scope": PER_DOCUMENT_SCOPE if agg.per_document else AGGREGATE_SCOPE}


def fact_sheet_statement(cfg: FactSheetPrivacyConfig, released: dict) -> dict:
    """The statement of the DP fact sheets (``dp_privacy.fact_sheet``): one
    ``plan.fact_sheet_report`` per collection, with its sheet where ``released`` (name ->
    ``plan.ReleasedSheet``) holds it. ``GET /v1/dp/budget`` answers it; ``vllm-dp account`` and
    ``vllm-dp release-facts`` print it."""
    from .plan import fact_sheet_report

    return {"enabled": True, "mode": "fact_sheet", "scope": FACT_SHEET_SCOPE,
            "contexts": [fact_sheet_report(cfg, name, released.get(name)) for name in cfg.collection_sources()]}


FACT_SHEET_SCOPE = "per collection: one release, then every query is free (the sheet is public)"
PER_DOCUMENT_SCOPE = ("per document: each document has its own lifetime cap, spent only by the answers its member "
                      "votes in (an individual privacy filter); no collection total")
AGGREGATE_SCOPE = ("per collection: each collection has its own total budget, spent by the queries "
                   "that use it (basic composition over queries)")


def context_lengths(config: DPPrivacyConfig, shape, model: str) -> dict[str, tuple[int, int]]:
    """(public head tokens, private rows) of each configured private context under ``model``'s
    tokenizer (decoder-only)."""
    from .serving.context import context_tokens

    att = config.attention
    if shape.is_encoder_decoder or not att.serves_context:
        return {}  # the plan refuses what does not fit the model (``plan.check_model``)
    spans = {}
    for name, path in att.context_files().items():
        tokens = context_tokens(path, str(model), att.context_key(name), att.public_head, att.document_tokens_or_none)
        spans[name] = (tokens.head, (tokens.end or len(tokens.ids)) - tokens.head)
    return spans


def budget_report(config: DPPrivacyConfig, statement: dict) -> str:
    """What each configured feature spends: DP attention from ``statement`` (``account_statement``),
    prompt privatization from the configuration."""
    if statement.get("mode") == "aggregate":
        parts = [aggregate_text(report) for report in statement["contexts"]]
    elif statement.get("mode") == "fact_sheet":
        parts = [fact_sheet_text(report) for report in statement["contexts"]]
    else:
        parts = [attention_report(report) for report in statement["contexts"]]
    if statement.get("scope"):
        parts.append(f"Budget scope: {statement['scope']}")
    if config.prompt is not None:
        parts.append(prompt_report(config.prompt))
    return "\n\n".join(parts) or "dp_privacy configures nothing: no privacy budget is spent (DP is off)."


PAPER_MODES = {"trlap_paper", "trlap_repro"}
METRIC_MODES = {"mahalanobis", "cmp"}


def prompt_report(prompt: PromptPrivacyConfig) -> str:
    """The per-token statement of prompt privatization; what a prompt of n user tokens spends
    (basic composition: n eps, n delta). The exact per-token statement needs the served model's
    embedding table (sensitivities, and the true delta of the paper calibrations): it is logged
    at serving start and returned in every request's receipt."""
    eps, delta = prompt.epsilon, prompt.delta
    overrides = f"  requests may override mechanism/epsilon: {prompt.allow_request_override}" + (
        f" (epsilon <= {prompt.max_epsilon:g})" if prompt.max_epsilon is not None else "")
    if prompt.mechanism == "paraphrase":
        cap = prompt.paraphrase_max_tokens
        return "\n".join([
            "Prompt privatization of user-authored tokens: paraphrase (the served model rewrites each user message)",
            "  unit of privacy: one user message (any two messages, their lengths included)",
            (f"  per output token: ({eps:g}, 0)-DP (exponential mechanism, logits clipped to "
             f"{prompt.paraphrase_width:g} below the top)"),
            f"  a message (basic composition over the cap of {cap} output tokens): ({eps * cap:g}, 0)",
            overrides,
        ])
    if prompt.mechanism in PAPER_MODES:
        guarantee = (f"{prompt.mechanism} (paper-literal reproduction): the claimed delta is NOT "
                     "valid for d > 1; the true delta is computed from the served table at start")
    elif prompt.mechanism in METRIC_MODES:
        guarantee = (f"{prompt.mechanism}: metric DP, eps = {eps:g} per unit embedding distance "
                     "(eps_DP = eps x the table's l2 diameter, in the receipt)")
    else:
        guarantee = f"{prompt.mechanism}: ({eps:g}, {delta:g})-DP per token"
    return "\n".join(
        [
            "Prompt privatization of user-authored tokens",
            ("  unit of privacy: one user token (replace-one, any token <-> any token); length, "
            "positions and template are not protected"),
            f"  per token: {guarantee}",
            (f"  a prompt of n user tokens (basic composition): ({eps:g} n, {delta:g} n); receipts "
            "also give advanced composition and count cached (reused) turns once"),
            overrides,
        ]
    )


def attention_report(report: dict) -> str:
    """One private context's statement (``ContextPlan.report()``), line by line."""
    where = (f"private context {report['name']!r}" if "name" in report else report.get("context", "the private context"))
    per, spent, planned = report["per_release"], report["spent"], report["planned"]
    return "\n".join(
        [
            f"DP attention over {where} ({report['context_tokens']} tokens; {report['kind']}, mode {report['mode']})",
            f"  regime: {report['regime']}",
            f"  unit of privacy: {report['unit']}",
            (f"  public head: the first {report['public_head_tokens']} tokens (exact, never released); private "
             f"span: {report['private_rows']} rows"),
            (f"  releases: {report['releases']} of {report['layers']} layers x {report['kv_heads']} KV heads per "
             f"release of the context (the gate's open layers); the budget covers "
             f"{report['releases_per_head']} release(s) of each"),
            f"  per (layer, KV head) release: {per['mechanism']}: {_budget(per)}-DP",
            f"  noise std per layer: {_numbers(report['noise_std'])}",
            f"  spent by one release of the context ({report['composition']} composition): {_budget(spent)}",
            f"  per document: {_per_document(report['per_document'])}",
            f"  planned ({planned['releases']} releases): {_budget(planned)} of the budget {_budget(report['budget'])}",
            f"  logit bound per layer: {_numbers(report['logit_bound'])}",
            f"  Taylor degree per layer: {_numbers(report['taylor_degree'])}",
            f"  kernel error per layer: {_numbers(report['kernel_error'])}",
            (f"  gate: relative error bound per layer (kernel + noise; open at <= "
             f"{report['gate']['threshold'] or 'off'}): {_numbers(report['gate']['relative_error'])}"),
        ]
    )


def aggregate_text(report: dict) -> str:
    """One collection's statement (``plan.aggregate_report``), line by line."""
    per = report["per_query"]
    if "selection" in report:  # mechanism answer
        sel = report["selection"]
        how = (f"  per query: one partition selection over the members' answers (discrete Laplace scale "
               f"{sel['scale']:.4g}, threshold {sel['threshold']})")
        head = f"({report['mechanism']}, {report['members']})"
    else:
        tok = report["per_private_token"]
        how = (f"  per private token: eps_select={tok['eps_select']:.4g}, eps_gate={tok['eps_gate']:.4g}; at most "
               f"{report['max_private_tokens']} private tokens a query (later tokens are public, free)")
        head = f"({report['mechanism']}, {report['members']} members, gate {report['gate']})"
    lines = [
        f"DP aggregation over collection {report['name']!r} {head}",
        f"  unit of privacy: {report['unit']}",
        (f"  per query: at most {_budget(per['worst_case'])} at the default eps {per['epsilon']:g} "
         f"(requests may ask for {per['min_epsilon']:g} to {per['max_epsilon']:g}); every query is charged at "
         f"least eps {per['min_epsilon']:g}: " + (
             f"the collection's budget pays for at most {report['max_queries']} queries" if report["max_queries"]
             else f"a document takes part in at most {report['max_answers_per_document']} answers")),
        how,
        f"  composition: {report['composition']}",
        ("  budget of each document (its lifetime cap): " + _budget(report["budget"]["per_document"])
         if "per_document" in report["budget"] else f"  budget of the collection: {_budget(report['budget'])}"),
        f"  released answers: {report['reuse']}",
        f"  not protected: {report['not_protected']}",
    ]
    for name, client in report.get("clients", {}).items():
        budget = client["budget"]
        line = (f"  client {name!r}: share {client['share']:g} of "
                + (f"each document's cap, {_budget(budget['per_document'])}" if "per_document" in budget
                   else f"the budget, {_budget(budget)}"))
        if "ledger" in client:
            line += f"; spent {_spent(client['ledger'])}"
        lines.append(line)
    if "ledger" in report:
        lines.append(f"  spent so far: {_spent(report['ledger'])}")
    return "\n".join(lines)


def fact_sheet_text(report: dict) -> str:
    """One collection's fact sheet statement (``plan.fact_sheet_report``), line by line."""
    rel = report["release"]
    lines = [
        f"DP fact sheet of collection {report['name']!r} (released once, served as a plain context)",
        f"  unit of privacy: {report['unit']}",
        f"  the release: {_budget(rel)}: {report['statement']}",
        "  per query: nothing (the sheet is public)",
        f"  not protected: {report['not_protected']}",
    ]
    if "budget" in report:
        lines.insert(3, "  budget of each document (its lifetime cap): " + _budget(report["budget"]["per_document"]))
    if "facts" in report:
        lines.append(f"  released facts ({len(report['facts'])}): "
                     + ("; ".join(f"{f['fact']} (~{f['noisy_count']})" for f in report["facts"]) or "none"))
        ledger = report["ledger"]
        lines.append(f"  releases of this collection: {ledger['releases_of_this_context']}, in total "
                     f"{_budget(ledger['total_spent'])}")
    return "\n".join(lines)


def _spent(ledger: dict) -> str:
    return f"{_budget(ledger['spent'])} by {ledger['queries']} queries; remaining {_budget(ledger['remaining'])}"


def _per_document(statement: dict | str) -> str:
    if isinstance(statement, str):
        return statement
    return (f"{_budget(statement['spent'])} for {statement['unit']} ({statement['documents']} documents); "
            "the line above is the row-level statement of the same release")


def _budget(b: dict) -> str:
    return f"(eps={b['epsilon']:.6g}, delta={b['delta']:.3g})"


def _numbers(values: list) -> str:
    return ", ".join("unbounded" if v is None else f"{v:.4g}" for v in values)
