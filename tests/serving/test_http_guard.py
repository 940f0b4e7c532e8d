"""The HTTP guard in front of the OpenAI routes while DP is on, and the start-up checks of the
endpoint plugin (layers verified through the workers, request logging)."""

import json
import logging

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI, WebSocket
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from vllm_dp_plugin.serving.http import PrivateContextGuard, allowed_post, forbidden_request

CONTEXT = allowed_post(frozenset({"context"}))
PROMPT = allowed_post(frozenset({"prompt"}))


@pytest.mark.parametrize(
    "path,body,status,field",
    [
        ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 0}, 400, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [], "return_token_ids": True}, 400, "return_token_ids"),
        ("/v1/chat/completions", {"messages": [], "vllm_xargs": {"prompt_logprobs": 1}}, 400, "prompt_logprobs"),
        ("/v1/completions", {"prompt_embeds": "AAAA"}, 400, "prompt_embeds"),
        ("/tokenize", {"prompt": "hi"}, 403, "/tokenize"),
        ("/v1/responses", {"input": "hi"}, 403, "/v1/responses"),
        ("/v1/completions", {"prompt": "hi", "cache_salt": "x"}, 400, "cache_salt"),
        ("/v1/completions", {"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}}, 400,
         "kv_transfer_params"),
        ("/invocations", {"prompt": "hi", "echo": True}, 400, "echo"),  # SageMaker: same checks
        ("/pooling", {"input": "hi"}, 403, "/pooling"),
        ("/generative_scoring", {"query": "hi"}, 403, "/generative_scoring"),
    ],
)
def test_leaking_requests_are_refused_naming_the_field(path, body, status, field):
    refusal = forbidden_request(path, body, CONTEXT, True)
    assert refusal is not None and refusal[0] == status and field in refusal[1]


def test_ordinary_requests_pass():
    assert forbidden_request("/v1/completions", {"prompt": "hi", "echo": False, "logprobs": 2}, CONTEXT, True) is None
    assert forbidden_request("/v1/chat/completions", {"messages": [], "prompt_logprobs": None}, CONTEXT, True) is None
    assert forbidden_request("/invocations", {"prompt": "hi"}, CONTEXT, True) is None
    assert forbidden_request("/ping", {}, CONTEXT, True) is None


def test_prompt_privatization_alone_closes_routes_that_skip_the_renderer():
    """With only the prompt section on, routes that tokenise by themselves (never privatized)
    are closed; the renderer's routes stay open, fields are not restricted."""
    for path in ("/generative_scoring", "/tokenize", "/pooling", "/v1/embeddings", "/classify"):
        assert forbidden_request(path, {}, PROMPT, False)[0] == 403
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                 "/v1/chat/completions/batch", "/invocations"):
        assert forbidden_request(path, {"echo": True}, PROMPT, False) is None


def test_routes_open_are_those_every_feature_on_can_serve():
    both = allowed_post(frozenset({"context", "prompt"}))
    assert both == CONTEXT and "/v1/responses" not in both
    whisper = allowed_post(frozenset({"encoder"}))
    assert "/v1/audio/transcriptions" in whisper and "/v1/completions" not in whisper


def _client(guard: bool, routes=CONTEXT) -> TestClient:
    app = FastAPI()
    app.add_middleware(PrivateContextGuard)
    app.state.dp_guard = guard
    app.state.dp_routes = routes

    @app.post("/v1/completions")
    async def completions(body: dict):
        return {"echoed_body": body}

    @app.post("/generative_scoring")
    async def scoring(body: dict):
        return {"scored": True}

    @app.websocket("/v1/realtime")
    async def realtime(socket: WebSocket):  # vLLM's realtime route takes input outside POST
        await socket.accept()
        await socket.send_text("open")
        await socket.close()

    return TestClient(app)


def test_middleware_answers_400_in_openai_error_format_and_forwards_the_body_intact():
    client = _client(guard=True)
    refused = client.post("/v1/completions", json={"prompt": "hi", "echo": True})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == 400 and "`echo` is not allowed" in error["message"]
    body = {"prompt": "hi", "max_tokens": 3}
    passed = client.post(
        "/v1/completions", content=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    assert passed.status_code == 200 and passed.json() == {"echoed_body": body}


FORGED = "/x%0Avllm-dp: refused nothing (a forged line)%0D%1B[2K" + "a" * 5000


def _raw_controls(text: str) -> list[str]:
    return [c for c in text if not c.isprintable()]


def test_a_refused_path_is_logged_and_echoed_as_one_escaped_bounded_line(caplog):
    """Log forging: the guard logged and echoed the decoded path, so ``POST /x%0A<line>`` wrote a
    line of the client's choosing into the server's log (``\r``, terminal escapes, megabytes too)."""
    caplog.set_level(logging.INFO, logger="vllm.dp_privacy")
    reply = _client(True).post(FORGED, json={})
    assert reply.status_code == 403
    echoed = reply.json()["error"]["message"]
    (record,) = [r for r in caplog.records if r.name == "vllm.dp_privacy"]
    for text in (echoed, record.getMessage()):
        assert not _raw_controls(text) and len(text) < 1000, text[:300]
        assert "\\n" in text and "\\r" in text and "\\x1b" in text and "..." in text  # escaped, cut
    assert echoed.startswith("/x\\nvllm-dp: refused nothing (a forged line)\\r\\x1b[2Kaaa")


def test_client_text_quoted_in_other_errors_is_escaped_and_cut():
    """The other places that echo a client's text raw: the fact sheet's unknown ``vllm_xargs``
    key, and DP aggregation's chat template error (a template may quote the client's message)."""
    from types import SimpleNamespace

    from vllm_dp_plugin.serving.aggregate import AggregateService, RequestError
    from vllm_dp_plugin.serving.fact_sheet import FactSheetError, FactSheetService

    forged = "dp_x\nvllm-dp: forged line\r\x1b[2K" + "a" * 5000
    with pytest.raises(FactSheetError) as unknown:
        FactSheetService.rewrite(SimpleNamespace(sheets={}), "/v1/completions", {"vllm_xargs": {forged: 1}})

    def template(*args, **kwargs):
        raise ValueError(f"unknown role {forged}")

    service = SimpleNamespace(tokenizer=SimpleNamespace(apply_chat_template=template))
    with pytest.raises(RequestError) as unrendered:
        AggregateService._render(service, [{"role": forged, "content": "hi"}])
    for text in (str(unknown.value), unrendered.value.message):
        assert not _raw_controls(text) and len(text) < 1000, text[:300]
        assert "\\n" in text and "\\x1b" in text and "..." in text


def test_websocket_routes_are_closed_while_dp_is_on():
    """vLLM registers a WebSocket route (/v1/realtime) whose input passes neither the POST
    allowlist nor the field checks: the guard passed WebSocket scopes through untouched."""
    for routes in (CONTEXT, PROMPT, allowed_post(frozenset({"aggregate"}))):
        with pytest.raises(WebSocketDisconnect) as closed, _client(guard=False, routes=routes).websocket_connect(
                "/v1/realtime") as socket:
            socket.receive_text()
        assert closed.value.code == 1008
    with _client(guard=False, routes=None).websocket_connect("/v1/realtime") as socket:  # DP off
        assert socket.receive_text() == "open"


def test_dev_mode_is_refused_while_dp_is_on(monkeypatch):
    from vllm import envs

    from vllm_dp_plugin.config import ConfigError
    from vllm_dp_plugin.serving.http import check_dev_mode

    monkeypatch.setattr(envs, "VLLM_SERVER_DEV_MODE", False, raising=False)
    check_dev_mode()
    monkeypatch.setattr(envs, "VLLM_SERVER_DEV_MODE", True, raising=False)
    with pytest.raises(ConfigError, match="VLLM_SERVER_DEV_MODE"):
        check_dev_mode()


def test_middleware_is_inert_with_dp_off():
    client = _client(guard=False, routes=None)
    assert client.post("/v1/completions", json={"echo": True}).status_code == 200
    assert client.post("/generative_scoring", json={}).status_code == 200


def test_middleware_closes_other_routes_with_prompt_privatization_alone():
    client = _client(guard=False, routes=PROMPT)
    assert client.post("/generative_scoring", json={"query": "x"}).status_code == 403
    assert client.post("/v1/completions", json={"echo": True}).status_code == 200


def test_replayed_body_is_delivered_once_then_the_client_stream_continues():
    import asyncio

    from vllm_dp_plugin.serving.http import _replay

    async def client():
        return {"type": "http.disconnect"}

    async def drain():
        receive = _replay(b"{}", client)
        return [await receive(), await receive()]

    first, second = asyncio.run(drain())
    assert first["body"] == b"{}" and second == {"type": "http.disconnect"}
