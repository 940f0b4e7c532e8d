"""HTTP surface of the plugin (``vllm.endpoint_plugins`` entry ``dp_privacy``).

* ``GET /v1/dp/budget``: the privacy statement of the served private context(s): (eps, delta)
  spent, per release and in total, and the guarantee's unit; and the per-token statement of
  prompt privatization when it is on.
* A guard in front of the OpenAI routes while a private context is served: requests that would
  reveal private positions (``echo``, ``prompt_logprobs``, ``return_token_ids``, prompt
  embeddings) get a 400 naming the field; POST routes outside the allowlist (tokenize,
  responses, ...) get a 403. The check reads only field names and flags, never logs text.
* While prompt privatization is on: the ``dp_*`` options of ``vllm_xargs`` are validated (400
  with the option's name) and handed to the renderer for this request; client-side
  ``prompt_embeds`` and ``kv_transfer_params.prompt_token_ids`` (both would bypass the
  renderer) get a 400; each response carries the receipts of its prompts in the header
  ``x-dp-prompt-receipts`` (JSON list, streaming included) and, for JSON bodies, in the field
  ``dp_prompt_receipts``. Only option fields are read, never text.
"""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from ..prompt.session import PromptRequest, bound_request, option_overrides, resolve_options
from .settings import PLUGIN_NAME, budget_payload, check_prompt_serving, dp_config, prompt_payload

logger = logging.getLogger("vllm.dp_privacy")  # inherits vLLM's log handler

ALLOWED_POST = ("/v1/completions", "/v1/chat/completions", "/detokenize")
# field -> why it is refused (a value counts as set unless it is None or False: 0 is set, since
# prompt_logprobs=0 still returns the logprob of every prompt token)
FORBIDDEN_FIELDS = {
    "echo": "echo would return the private context with the prompt",
    "prompt_logprobs": "prompt_logprobs are computed at private positions",
    "return_token_ids": "return_token_ids returns the prompt's token ids, private context included",
    "prompt_embeds": "prompt embeddings cannot be placed after the private context",
}


def forbidden_request(path: str, body: dict) -> tuple[int, str] | None:
    """(status, message) if a request must be refused while a private context is served."""
    if path not in ALLOWED_POST:
        return 403, f"{path} is not available while a private context is served"
    extra = body.get("vllm_xargs") if isinstance(body.get("vllm_xargs"), dict) else {}
    for field, why in FORBIDDEN_FIELDS.items():
        if any(_is_set(part.get(field)) for part in (body, extra)):
            return 400, f"`{field}` is not allowed: {why}"
    return forwarded_ids(body)


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
    kind = "BadRequestError" if status == 400 else "PermissionDeniedError"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class PrivateContextGuard:
    """ASGI middleware: refuses leaking requests once ``app.state.dp_guard`` is on (private
    context); with ``app.state.dp_prompt`` (prompt privatization) validates the request's prompt
    options, makes them current for the renderer and adds the receipts to the response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        state = scope["app"].state
        guard, prompt_cfg = getattr(state, "dp_guard", False), getattr(state, "dp_prompt", None)
        if not guard and prompt_cfg is None:
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
        refusal = forbidden_request(scope["path"], parsed) if guard else None
        if refusal is None and prompt_cfg is not None:
            refusal = prompt_refusal(parsed, prompt_cfg)
        if refusal is not None:
            logger.info("vllm-dp: refused %s (%s)", scope["path"], refusal[1].split(":")[0])
            return await _error(*refusal)(scope, receive, send)
        if prompt_cfg is None:
            return await self.app(scope, _replay(body, receive), send)
        xargs = parsed.get("vllm_xargs") if isinstance(parsed.get("vllm_xargs"), dict) else {}
        with bound_request(PromptRequest(option_overrides(xargs))) as request:
            return await self.app(scope, _replay(body, receive), _with_receipts(send, request))


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


@router.get("/v1/dp/budget")
async def dp_budget(request: Request) -> JSONResponse:
    payload = getattr(request.app.state, "dp_budget", None)
    if payload is None:
        return _error(400, "the server was started without the dp_privacy plugin state")
    return JSONResponse(payload)


class DPPrivacyEndpoints:
    """The endpoint plugin object vLLM instantiates (name = the VLLM_PLUGINS allowlist name)."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)
        app.add_middleware(PrivateContextGuard)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:
            state.dp_budget, state.dp_guard, state.dp_prompt = {"enabled": False}, False, None
            return
        vllm_config = engine_client.vllm_config
        cfg = dp_config(vllm_config)
        check_prompt_serving(vllm_config, cfg)
        state.dp_budget = budget_payload(vllm_config)
        if cfg.prompt is not None:
            state.dp_budget["prompt"] = prompt_payload(cfg.prompt)
        state.dp_guard = cfg.attention is not None and cfg.attention.private_context is not None
        state.dp_prompt = cfg.prompt
        logger.info("vllm-dp: privacy budget %s", json.dumps(state.dp_budget))
