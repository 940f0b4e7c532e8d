"""The HTTP guard in front of the OpenAI routes while a private context is served."""

import json

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI
from fastapi.testclient import TestClient

from vllm_dp_plugin.serving.http import PrivateContextGuard, forbidden_request


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
    ],
)
def test_leaking_requests_are_refused_naming_the_field(path, body, status, field):
    refusal = forbidden_request(path, body)
    assert refusal is not None and refusal[0] == status and field in refusal[1]


def test_ordinary_requests_pass():
    assert forbidden_request("/v1/completions", {"prompt": "hi", "echo": False, "logprobs": 2}) is None
    assert forbidden_request("/v1/chat/completions", {"messages": [], "prompt_logprobs": None}) is None


def _client(guard: bool) -> TestClient:
    app = FastAPI()
    app.add_middleware(PrivateContextGuard)
    app.state.dp_guard = guard

    @app.post("/v1/completions")
    async def completions(body: dict):
        return {"echoed_body": body}

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


def test_middleware_is_inert_without_a_private_context():
    assert _client(guard=False).post("/v1/completions", json={"echo": True}).status_code == 200


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
