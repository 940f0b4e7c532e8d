"""HTTP surface of the plugin (``vllm.endpoint_plugins`` entry ``dp_privacy``).

* ``GET /v1/dp/budget``: the privacy statement of each served private context (name, keyed
  label, tokens): (eps, delta) spent, per release and in total, and the guarantee's unit; and the
  per-token statement of prompt privatization when it is on. DP aggregation's client ledgers go
  to their own client's bearer key, all of them to the operator's (``AggregateService.viewer``);
  its ledger reads are shared and run on a thread of their own (``BUDGET_READS``).
* A guard in front of the OpenAI routes while any DP feature is on: POST routes outside the
  allowlist of the features on (``allowed_post``: the routes whose prompts go through the
  ``dp_private`` renderer, or, for Whisper, the transcription routes) get a 403, so a route that
  tokenises by itself (``/generative_scoring``, ``/tokenize``, pooling) cannot bypass it. While a
  private context is served, requests that would reveal private positions (``echo``,
  ``prompt_logprobs``, ``return_token_ids``, prompt embeddings) or recompute or export them
  (``cache_salt``, ``kv_transfer_params``) get a 400 naming the field. The check reads only field
  names and flags, never logs text.
* At start-up (``init_state``): every worker's every attention layer is checked to be a DP impl
  holding the renderer's contexts (``verify``), and request logging at DEBUG (which logs prompt
  ids and bodies) is refused.
* While private contexts are served: ``vllm_xargs.dp_context`` must name one (400 naming the
  option and the known names) and is handed to the renderer for this request; without prompt
  privatization any other ``dp_*`` option gets a 400 too (a typo must not silently pick the
  default context).
* While prompt privatization is on: the ``dp_*`` options of ``vllm_xargs`` are validated (400
  with the option's name) and handed to the renderer for this request; client-side
  ``prompt_embeds`` and ``kv_transfer_params.prompt_token_ids`` (both would bypass the
  renderer) get a 400; each response carries the receipts of its prompts in the header
  ``x-dp-prompt-receipts`` (JSON list, streaming included) and, for JSON bodies, in the field
  ``dp_prompt_receipts``. Only option fields are read, never text.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from ..config import ConfigError
from ..plan import release_fact_sheets
from ..privacy.keyed_noise import NoiseKey
from ..privacy.ledger_store import LedgerUnavailable
from ..privacy.release_ledger import ReleaseLedger
from ..prompt.session import (
    OPTION_CONTEXT,
    PromptRequest,
    bound_request,
    check_option_names,
    option_overrides,
    resolve_options,
)
from .aggregate import ROUTES as AGGREGATE_ROUTES
from .aggregate import AggregateService, RequestError, check_batch_invariance
from .context import select_context
from .echo import printable
from .fact_sheet import ROUTES as FACT_SHEET_ROUTES
from .fact_sheet import FactSheetError, FactSheetService
from .settings import (
    PLUGIN_NAME,
    ModelShape,
    budget_payload,
    check_engine_options,
    check_prompt_serving,
    contexts_out_of_regime,
    dp_config,
    private_contexts,
    private_prompts,
)
from .verify import LAYER_REPORT, check_layers

logger = logging.getLogger("vllm.dp_privacy")  # inherits vLLM's log handler

# POST routes each DP feature can serve (``/invocations`` is SageMaker's alias of chat and
# completions for a generate model, ``/ping`` its health check). Every other POST route gets 403.
HARMLESS_POST = ("/detokenize", "/ping")
CONTEXT_POST = ("/v1/completions", "/v1/chat/completions", "/invocations", *HARMLESS_POST)
PROMPT_POST = (*CONTEXT_POST, "/v1/chat/completions/batch", "/v1/responses", "/v1/messages")
ENCODER_POST = ("/v1/audio/transcriptions", "/v1/audio/translations", *HARMLESS_POST)
AGGREGATE_POST = (*AGGREGATE_ROUTES, *HARMLESS_POST)
FACT_SHEET_POST = (*FACT_SHEET_ROUTES, *HARMLESS_POST)  # a route not rewritten would answer without the sheet
# Closed to every method but POST (allowlisted above) while private prompts run through the
# engine (DP aggregation's members, paraphrase rewrites): whatever reaches vLLM's Prometheus
# registry, whose counters (prompt tokens, prefix-cache hits, request and response sizes) add up
# their lengths. vLLM 0.32 serves it from two routes (entrypoints/serve/instrumentator/metrics.py):
# the instrumentator's GET /metrics and a Mount whose path_regex ``^/metrics(?P<path>.*)$`` answers
# /metrics/, /metrics/x, /metricsx, /metrics.txt, any method (``reaches_counters``). The other
# non-POST routes vLLM serves state no engine counter and stay open: /health, /ping, /version,
# /v1/models, /tokenizer_info, /docs, /redoc, /openapi.json, /static (public); /load (HTTP requests
# in flight, never tokens; aggregation's members are not HTTP requests); /kv_event_sources (the
# publisher's configuration; KV events are refused); /fault_tolerance/status (engine health);
# /v1/responses/{id} (a response stored for its client); under VLLM_SERVER_DEV_MODE /server_info
# (the configuration), /is_sleeping, /is_paused, /weight_info, /get_world_size.
COUNTERS_PATH = "/metrics"
COUNTERS_CLOSED = ("/metrics is not available while private prompts run through the engine (DP aggregation, "
                   "paraphrase): its counters add up their lengths")
# WebSocket routes (vLLM's /v1/realtime) take their input outside the POST allowlist and the
# field checks: closed while any DP feature is on
WEBSOCKET_CLOSED = "WebSocket routes are not available while differential privacy is on"
# field -> why it is refused (a value counts as set unless it is None or False: 0 is set, since
# prompt_logprobs=0 still returns the logprob of every prompt token)
FORBIDDEN_FIELDS = {
    "echo": "echo would return the private context with the prompt",
    "prompt_logprobs": "prompt_logprobs are computed at private positions",
    "return_token_ids": "return_token_ids returns the prompt's token ids, private context included",
    "prompt_embeds": "prompt embeddings cannot be placed after the private context",
    "kv_transfer_params": "KV transfer would export or import the private context's cache rows",
    "cache_salt": "a cache salt makes the engine recompute the whole private context",
}


def reaches_counters(scope) -> bool:
    """Whether a request reaches vLLM's Prometheus registry: its path (as sent, and as Starlette
    routes it: less the root path) starts with ``/metrics`` (the Mount's pattern serves every such
    path) or matches the pattern of any route of the app that serves ``/metrics`` itself (read from
    the app's routes, so a pattern a later vLLM widens is followed)."""
    patterns = counter_patterns(scope["app"])
    return any(path.startswith(COUNTERS_PATH) or any(p.match(path) for p in patterns) for path in _paths(scope))


def counter_patterns(app) -> list:
    """The path patterns of ``app``'s routes that answer ``/metrics`` (vLLM's metrics route and Mount)."""
    patterns = (getattr(route, "path_regex", None) for route in getattr(app, "routes", ()))
    return [p for p in patterns if p is not None and p.match(COUNTERS_PATH)]


def _paths(scope) -> set[str]:
    """The request's path and its route path (without ``root_path``, as ``starlette`` matches)."""
    path, root = scope["path"], scope.get("root_path", "")
    return {path, path[len(root):]} if root and path.startswith(root + "/") else {path}


def allowed_post(features: frozenset[str]) -> frozenset[str]:
    """The POST routes open while ``features`` (of "context", "prompt", "encoder") are on: those
    every feature on can serve."""
    routes = {"context": CONTEXT_POST, "prompt": PROMPT_POST, "encoder": ENCODER_POST, "aggregate": AGGREGATE_POST,
              "fact_sheet": FACT_SHEET_POST}
    return frozenset.intersection(*(frozenset(routes[f]) for f in features))


def forbidden_request(path: str, body: dict, allowed: frozenset[str], context: bool) -> tuple[int, str] | None:
    """(status, message) if a request must be refused: a POST route not in ``allowed``, or, with
    a private ``context``, a field that would reveal, recompute or export private positions. The
    path is the client's text: echoed escaped and cut (``printable``)."""
    if path not in allowed:
        return 403, f"{printable(path)} is not available while differential privacy is on"
    if not context:
        return None
    extra = body.get("vllm_xargs") if isinstance(body.get("vllm_xargs"), dict) else {}
    for field, why in FORBIDDEN_FIELDS.items():
        if any(_is_set(part.get(field)) for part in (body, extra)):
            return 400, f"`{field}` is not allowed: {why}"
    return None


RECEIPT_HEADER = "x-dp-prompt-receipts"
RECEIPT_FIELD = "dp_prompt_receipts"


def prompt_refusal(body: dict, prompt_cfg) -> tuple[int, str] | None:
    """(400, message) for a request prompt privatization cannot honour: client-side prompt
    embeddings, forwarded prompt token ids, or bad ``dp_*`` options (``vllm_xargs``)."""
    xargs = body.get("vllm_xargs") if isinstance(body.get("vllm_xargs"), dict) else {}
    if _is_set(body.get("prompt_embeds")) or _is_set(xargs.get("prompt_embeds")):
        return 400, "`prompt_embeds` is not allowed: client-side embeddings bypass prompt privatization"
    refusal = forwarded_ids(body)
    if refusal is not None:
        return refusal
    try:
        resolve_options(option_overrides(xargs), prompt_cfg)
    except ValueError as exc:
        return 400, str(exc)
    return None


def context_refusal(body: dict, contexts: tuple[str, ...], prompt: bool) -> tuple[int, str] | None:
    """(400, message) for a ``vllm_xargs.dp_context`` naming none of the served ``contexts`` (any
    name when none is served) and, without prompt privatization (whose options ``prompt_refusal``
    checks), for any other ``dp_*`` option."""
    overrides = option_overrides(body.get("vllm_xargs"))
    try:
        if not prompt:
            check_option_names(overrides, (OPTION_CONTEXT,))
        if overrides.get(OPTION_CONTEXT) is not None:
            select_context(contexts, overrides[OPTION_CONTEXT])
    except ValueError as exc:
        return 400, str(exc)
    return None


def forwarded_ids(body: dict) -> tuple[int, str] | None:
    """``kv_transfer_params.prompt_token_ids`` makes vLLM skip templating and the renderer
    (disaggregated prefill): refused while the renderer must see every prompt."""
    kv = body.get("kv_transfer_params")
    if isinstance(kv, dict) and kv.get("prompt_token_ids") is not None:
        return 400, (
            "`kv_transfer_params.prompt_token_ids` is not allowed: forwarded token ids bypass "
            "the dp_private renderer"
        )
    return None


def _is_set(value) -> bool:
    return value is not None and value is not False


def _error(status: int, message: str) -> JSONResponse:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 503: "ServiceUnavailableError"}.get(
        status, "PermissionDeniedError")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class PrivateContextGuard:
    """ASGI middleware: refuses POST routes outside ``app.state.dp_routes`` (any DP feature on)
    and leaking requests while ``app.state.dp_guard`` is on (private context); with
    ``app.state.dp_contexts`` (the served contexts' names) or ``app.state.dp_prompt`` (prompt
    privatization) validates the request's ``dp_*`` options and makes them current for the
    renderer; with prompt privatization adds the receipts to the response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and getattr(scope["app"].state, "dp_routes", None) is not None:
            await receive()  # websocket.connect; a close before accepting is an HTTP 403
            return await send({"type": "websocket.close", "code": 1008, "reason": WEBSOCKET_CLOSED})
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope["app"].state
        if scope["method"] != "POST":
            if getattr(state, "dp_counters_closed", False) and reaches_counters(scope):
                return await _error(403, COUNTERS_CLOSED)(scope, receive, send)
            return await self.app(scope, receive, send)
        routes = getattr(state, "dp_routes", None)
        guard, prompt_cfg = getattr(state, "dp_guard", False), getattr(state, "dp_prompt", None)
        contexts = getattr(state, "dp_contexts", ())
        if routes is None:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            parsed = json.loads(body or b"{}")
        except ValueError:
            parsed = {}
        parsed = parsed if isinstance(parsed, dict) else {}
        refusal = forbidden_request(scope["path"], parsed, routes, guard)
        if refusal is None and prompt_cfg is not None:
            refusal = prompt_refusal(parsed, prompt_cfg)
        if refusal is None and (contexts or prompt_cfg is not None):
            refusal = context_refusal(parsed, contexts, prompt_cfg is not None)
        if refusal is not None:
            # the path and option names are the client's: one escaped, bounded line (no forged record)
            logger.info("vllm-dp: refused %s (%s)", printable(scope["path"]), printable(refusal[1].split(":")[0]))
            return await _error(*refusal)(scope, receive, send)
        service = getattr(state, "dp_aggregate", None)
        if service is not None and scope["path"] in AGGREGATE_ROUTES:
            return await (await service.handle(scope["path"], parsed, scope.get("headers", [])))(scope, receive, send)
        sheets = getattr(state, "dp_fact_sheet", None)
        if sheets is not None and scope["path"] in FACT_SHEET_ROUTES:
            try:
                body = json.dumps(sheets.rewrite(scope["path"], parsed), ensure_ascii=False).encode("utf-8")
            except FactSheetError as exc:
                return await _error(400, str(exc))(scope, receive, send)
            scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
                     + [(b"content-length", str(len(body)).encode("ascii"))]}
        if prompt_cfg is None and not contexts:
            return await self.app(scope, _replay(body, receive), send)
        overrides = option_overrides(parsed.get("vllm_xargs"))
        with bound_request(PromptRequest.from_http(overrides, scope.get("headers", []))) as request:
            reply = send if prompt_cfg is None else _with_receipts(send, request)
            return await self.app(scope, _replay(body, receive), reply)


def _with_receipts(send, request: PromptRequest):
    """An ASGI ``send`` that adds ``request``'s receipts to the response: the header
    ``x-dp-prompt-receipts`` always, the field ``dp_prompt_receipts`` in JSON object bodies
    (buffered to fix Content-Length). The renderer ran before the response started."""
    held: dict = {}
    chunks: list[bytes] = []

    def receipts() -> list[dict]:
        return [r for r in request.receipts if r is not None]

    async def wrapped(message):
        kind = message["type"]
        if kind == "http.response.start":
            found = receipts()
            if not found:
                return await send(message)
            headers = [(k, v) for k, v in message.get("headers", [])]
            headers.append((RECEIPT_HEADER.encode(), json.dumps(found, separators=(",", ":")).encode("ascii")))
            message = {**message, "headers": headers}
            content_type = dict(headers).get(b"content-type", b"")
            if content_type.startswith(b"application/json"):
                held["start"] = message
                return None
            return await send(message)
        if kind == "http.response.body" and "start" in held:
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return None
            return await _send_json_with_receipts(send, held.pop("start"), b"".join(chunks), receipts())
        return await send(message)

    return wrapped


async def _send_json_with_receipts(send, start: dict, body: bytes, found: list[dict]) -> None:
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        payload[RECEIPT_FIELD] = found
        body = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode("ascii")))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _replay(body: bytes, receive):
    """An ASGI ``receive`` that yields the already-read body once, then defers to the client's
    (vLLM listens on it for disconnects: answering the body forever would spin the event loop)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


router = APIRouter()


# /v1/dp/budget's ledger reads run here, one at a time, never on the default thread pool that
# reservations use (``asyncio.to_thread``): no number of budget calls can hold their threads
BUDGET_READS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-dp-budget")


@router.get("/v1/dp/budget")
async def dp_budget(request: Request) -> JSONResponse:
    payload = getattr(request.app.state, "dp_budget", None)
    if payload is None:
        return _error(400, "the server was started without the dp_privacy plugin state")
    if not isinstance(payload, DynamicBudget):
        return JSONResponse(payload)
    try:
        compute = payload.for_request(request.headers.raw)
        return JSONResponse(await asyncio.get_running_loop().run_in_executor(BUDGET_READS, compute))
    except RequestError as exc:  # a bearer key that names no one
        return _error(exc.status, exc.message)
    except LedgerUnavailable as exc:  # the database is down or unreadable: say so, not a 500
        logger.error("vllm-dp: %s", exc)
        return _error(503, "the budget ledger cannot be read (see the server's log)")


class DynamicBudget:
    """A statement computed at each ``/v1/dp/budget`` call (DP aggregation: spending changes):
    ``compute(view)`` (blocking: it may read the ledger) with the view a request's headers give
    (``viewer(headers)``: DP aggregation's clients whose ledgers the caller may see; RequestError
    401 for a key that names no one); without a viewer ``compute()`` for every caller."""

    def __init__(self, compute, viewer=None):
        self.compute, self.viewer = compute, viewer

    def for_request(self, headers) -> Callable[[], dict]:
        """The call that computes the statement of a request with ``headers`` (ASGI's)."""
        return self.compute if self.viewer is None else functools.partial(self.compute, self.viewer(headers))


def _payload(budget) -> dict:
    """The statement a caller without a key gets (the start-up log's: readers of the log are
    not the operator)."""
    return budget.for_request(())() if isinstance(budget, DynamicBudget) else budget


class DPPrivacyEndpoints:
    """The endpoint plugin object vLLM instantiates (name = the VLLM_PLUGINS allowlist name).
    Loaded for every task (``required_tasks = None``): a pooling server must get the guard too."""

    name = PLUGIN_NAME
    required_tasks = None

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)
        app.add_middleware(PrivateContextGuard)

    async def init_state(self, engine_client, state, args) -> None:
        state.dp_budget, state.dp_guard, state.dp_prompt, state.dp_routes = {"enabled": False}, False, None, None
        state.dp_contexts, state.dp_aggregate, state.dp_counters_closed = (), None, False
        state.dp_fact_sheet = None
        if engine_client is None:  # the CPU-only render server: no engine, nothing private
            return
        vllm_config = engine_client.vllm_config
        cfg = dp_config(vllm_config)
        features = dp_features(vllm_config, cfg)
        if not features:
            return
        check_prompt_serving(vllm_config, cfg)
        check_request_logging(args)
        check_dev_mode()
        state.dp_counters_closed = private_prompts(cfg)
        check_log_stats(args, state.dp_counters_closed)
        if cfg.attention is not None:
            await verify_engine(engine_client, vllm_config)
        if cfg.aggregate is not None:
            state.dp_aggregate = aggregate_service(engine_client, vllm_config, cfg, args)
            state.dp_budget = DynamicBudget(state.dp_aggregate.statement, state.dp_aggregate.viewer)
        elif cfg.fact_sheet is not None:
            state.dp_fact_sheet = fact_sheet_service(engine_client, cfg)
            state.dp_budget = state.dp_fact_sheet.statement
        else:
            state.dp_budget = budget_payload(vllm_config)  # prompt privatization's statement included
        state.dp_guard = bool(features & {"context", "aggregate"})
        if "context" in features:
            state.dp_contexts = tuple(c.name for c in private_contexts(vllm_config))
        state.dp_prompt = cfg.prompt
        if cfg.prompt is not None and hasattr(getattr(engine_client, "renderer", None), "attach_engine"):
            engine_client.renderer.attach_engine(engine_client, await paraphrase_refusal(engine_client))
        state.dp_routes = allowed_post(features)
        logger.info("vllm-dp: privacy budget %s", json.dumps(_payload(state.dp_budget)))


async def paraphrase_refusal(engine_client) -> str | None:
    """Why paraphrase rewrites cannot run on this engine (its workers do not all run the
    mechanism's logits processor: ``paraphrase.check_processors``), None when they can."""
    from .paraphrase import LOGITS_REPORT, check_processors

    try:
        check_processors(await engine_client.collective_rpc(LOGITS_REPORT))
    except Exception as exc:  # noqa: BLE001 - fail closed: paraphrase requests get this reason
        logger.warning("vllm-dp: prompt mechanism paraphrase is refused on this server: %s", exc)
        return str(exc)
    return None


def dp_features(vllm_config, cfg) -> frozenset[str]:
    """Which DP features this server runs: "context" (a private context), "encoder" (DP
    cross-attention over each request's encoder output), "prompt" (prompt privatization),
    "aggregate" (DP aggregation at the output over document collections), "fact_sheet" (DP fact
    sheets served as plain contexts)."""
    features = set()
    if cfg.aggregate is not None:
        features.add("aggregate")
    if cfg.fact_sheet is not None:
        features.add("fact_sheet")
    if cfg.attention is not None:
        enc_dec = bool(getattr(vllm_config.model_config, "is_encoder_decoder", False))
        features.add("encoder" if enc_dec else "context")
    if cfg.prompt is not None:
        features.add("prompt")
    return frozenset(features)


def aggregate_service(engine_client, vllm_config, cfg, args) -> AggregateService:
    """The DP aggregation service (``dp_privacy.aggregate``): collections loaded and partitioned,
    engine options checked (nothing that reads or publishes cached rows)."""
    check_engine_options(vllm_config, "dp_privacy.aggregate")
    check_batch_invariance(cfg.aggregate)
    tokenizer = engine_client.get_tokenizer()
    model_config = vllm_config.model_config
    stops = {tokenizer.eos_token_id} - {None}
    # the model's and its generation config's end tokens: where a request would have stopped
    for eos in (getattr(model_config.hf_config, "eos_token_id", None),
                model_config.try_get_generation_config().get("eos_token_id")):
        stops.update(t for t in (eos if isinstance(eos, list) else [eos]) if t is not None)
    names = getattr(args, "served_model_name", None)
    name = names[0] if names else vllm_config.model_config.model
    key = NoiseKey(cfg.key_file)
    service = AggregateService(cfg.aggregate, engine_client, tokenizer, key, name, tuple(sorted(stops)),
                               vllm_config.model_config.max_model_len, cfg.ledger_store(key))
    logger.info("vllm-dp: DP aggregation over %d collection(s), %d members each (unit: one document)",
                len(service.collections), cfg.aggregate.members)
    return service


def fact_sheet_service(engine_client, cfg) -> FactSheetService:
    """The DP fact sheets (``dp_privacy.fact_sheet``): every collection loaded (documents counted
    with the served tokenizer) and released once, before the server answers anything."""
    tokenizer = engine_client.get_tokenizer()
    key = NoiseKey(cfg.key_file)
    released = release_fact_sheets(cfg.fact_sheet, key, ReleaseLedger(key, cfg.ledger_store(key)),
                           lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    for name, r in released.items():  # the sheet is public: its size may be logged
        logger.info("vllm-dp: fact sheet of collection %r released: %d facts, %s", name, len(r.sheet.facts),
                    r.history.to_json()["total_spent"])
    return FactSheetService(cfg.fact_sheet, released)


def check_log_stats(args, private: bool) -> None:
    """Refuse to serve ``private`` prompts with vLLM's periodic stats log on: its "Avg prompt
    throughput" line adds up their lengths (``vllm-dp serve`` passes ``--disable-log-stats``)."""
    if private and not getattr(args, "disable_log_stats", False):
        raise ConfigError("dp_privacy: DP aggregation and paraphrase need --disable-log-stats (vLLM's stats log "
                          "counts the private prompts' tokens); vllm-dp serve adds it")


def check_dev_mode() -> None:
    """Refuse ``VLLM_SERVER_DEV_MODE`` while a DP feature is on: its routes serve the engine's
    configuration (the ``dp_privacy`` section included) and control it (``/reset_prefix_cache``,
    ``/sleep``), outside what the guard reasons about."""
    from vllm import envs

    if envs.VLLM_SERVER_DEV_MODE:
        raise ConfigError("dp_privacy: VLLM_SERVER_DEV_MODE exposes and controls the engine through routes the DP "
                          "guard does not cover; unset it while a DP feature is on")


def check_request_logging(args) -> None:
    """Refuse ``--enable-log-requests`` at DEBUG level: vLLM then logs every prompt's ids (the
    private context's included) and the raw request body (the user's unprivatized text)."""
    if getattr(args, "enable_log_requests", False) and logging.getLogger("vllm").isEnabledFor(logging.DEBUG):
        raise ConfigError(
            "dp_privacy: --enable-log-requests at DEBUG log level logs prompt token ids and request "
            "bodies; drop the flag or raise VLLM_LOGGING_LEVEL to INFO"
        )


async def verify_engine(engine_client, vllm_config) -> None:
    """Ask every worker for its layers and refuse to serve unless the DP path covers them."""
    shape = ModelShape.of(vllm_config)
    try:
        reports = await engine_client.collective_rpc(LAYER_REPORT)
    except NotImplementedError:
        raise ConfigError(
            "dp_privacy: the engine's workers do not answer the DP layer check (the vllm-dp general "
            "plugin is not loaded in them): refusing to serve"
        ) from None
    if shape.is_encoder_decoder:
        layers, labels = shape.cross_layers, None
    elif contexts_out_of_regime(vllm_config):
        logger.warning("vllm-dp: no private context is served (every one is out of regime, see /v1/dp/budget): "
                       "requests are answered without it; the DP layers are off")
        return
    else:
        layers, labels = shape.self_layers, [c.identity.label for c in private_contexts(vllm_config)]
    check_layers(reports, layers=layers, labels=labels, scale=shape.scale)
    logger.info("vllm-dp: verified: all %d attention layers that see private rows run the DP path on %d "
                "worker(s)", layers, len(reports))
