"""HTTP surface of the plugin (``vllm.endpoint_plugins`` entry ``dp_privacy``).

* ``GET /v1/dp/budget``: the privacy statement of the served private context(s): (eps, delta)
  spent, per release and in total, and the guarantee's unit.
* A guard in front of the OpenAI routes while a private context is served: requests that would
  reveal private positions (``echo``, ``prompt_logprobs``, ``return_token_ids``, prompt
  embeddings) get a 400 naming the field; POST routes outside the allowlist (tokenize,
  responses, ...) get a 403. The check reads only field names and flags, never logs text.
"""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from .settings import PLUGIN_NAME, budget_payload, dp_config

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
    return None


def _is_set(value) -> bool:
    return value is not None and value is not False


def _error(status: int, message: str) -> JSONResponse:
    kind = "BadRequestError" if status == 400 else "PermissionDeniedError"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class PrivateContextGuard:
    """ASGI middleware: refuses leaking requests once ``app.state.dp_guard`` is on."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if not getattr(scope["app"].state, "dp_guard", False):
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
        refusal = forbidden_request(scope["path"], parsed if isinstance(parsed, dict) else {})
        if refusal is not None:
            logger.info("vllm-dp: refused %s (%s)", scope["path"], refusal[1].split(":")[0])
            return await _error(*refusal)(scope, receive, send)

        return await self.app(scope, _replay(body, receive), send)


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
            state.dp_budget, state.dp_guard = {"enabled": False}, False
            return
        vllm_config = engine_client.vllm_config
        cfg = dp_config(vllm_config)
        state.dp_budget = budget_payload(vllm_config)
        state.dp_guard = cfg.attention is not None and cfg.attention.private_context is not None
        logger.info("vllm-dp: privacy budget %s", json.dumps(state.dp_budget))
