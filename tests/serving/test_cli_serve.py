"""`vllm-dp serve --dp-config` end to end: vLLM's OpenAI server with a private context.

One server (start ~60-90 s): chat and completions answer, the private context is applied
(completions equal `LLM` with the same deployment), `/v1/dp/budget` states the guarantee, and
leaking options are refused with 400.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from vllm_dp_plugin.serving.vllm_compat import installed_vllm_version

from .engines import dp_section, run_engine, write_dp_yaml

PROMPT = "The quick brown fox"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def request(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.vllm
def test_version_shim_reports_cpu_build():
    assert installed_vllm_version().endswith("+cpu")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base url, model dir, dp section) of a running `vllm-dp serve --dp-config` server."""
    from vllm_dp_plugin.demo import make_demo_llama

    tmp = tmp_path_factory.mktemp("serve")
    model = make_demo_llama(tmp / "llama")
    section = dp_section(tmp, 2.0)
    config = write_dp_yaml(tmp / "dp.yaml", section)
    port = free_port()
    cli = str(Path(sys.executable).with_name("vllm-dp"))  # the console script of this venv
    log_path = tmp / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [cli, "serve", str(model), "--dp-config", str(config), "--host", "127.0.0.1",
             "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
             "--block-size", "32", "--enforce-eager"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(2)
        else:
            pytest.fail("server did not come up in 400 s")
        yield base, str(model), section, log_path
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.vllm
def test_chat_and_completions_answer(server):
    base, model, _, _ = server
    status, chat = request(base + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
        "temperature": 0})
    assert status == 200 and chat["usage"]["completion_tokens"] == 8
    # the private context is part of the prompt the engine saw, but not of what the user sent
    status, done = request(base + "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert status == 200 and done["usage"]["prompt_tokens"] > 40


@pytest.mark.vllm
def test_server_release_equals_llm_with_the_same_key_and_config(server):
    base, model, section, _ = server
    _, done = request(base + "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    offline = run_engine({"model": model, "llm": {
        "tokenizer_mode": "dp_private", "additional_config": {"dp_privacy": section}},
        "steps": [{"prompts": [PROMPT], "max_tokens": 8}]})[0]
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(model).decode(offline["token_ids"][0], skip_special_tokens=True)
    # vLLM's incremental detokenizer withholds an incomplete UTF-8 byte sequence at the end
    # (byte-fallback tokens) where a one-shot decode prints U+FFFD replacement characters
    assert done["choices"][0]["text"] == text.rstrip("\ufffd")


@pytest.mark.vllm
def test_budget_endpoint_and_startup_log_state_the_guarantee(server):
    base, _, section, log_path = server
    status, budget = request(base + "/v1/dp/budget")
    assert status == 200 and budget["enabled"]
    (ctx,) = budget["contexts"]
    assert ctx["unit"].startswith("one private K/V row of one attention layer")
    assert ctx["releases"] == 2 * 2 and ctx["budget"]["epsilon"] == section["attention"]["epsilon"]
    assert ctx["spent"]["epsilon"] == pytest.approx(2.0, rel=1e-6)
    assert ctx["spent"]["delta"] <= 1e-6
    log = log_path.read_text()
    assert "vllm-dp: DP attention on" in log and "Bluebird" not in log  # never log private text
    assert "vllm-dp: verified: all 2 attention layers" in log  # the start-up layer check ran


@pytest.mark.vllm
def test_budget_label_is_no_guessing_oracle(server):
    """The attack on the unkeyed context label: with the public config and the context's tokens, recompute the
    old unkeyed label (SHA-256 of model path, config and ids) and look for it in the budget and
    the log. The served label is keyed: it matches no such recomputation."""
    import hashlib

    from transformers import AutoTokenizer

    from vllm_dp_plugin.serving.context import tokenize_context

    base, model, section, log_path = server
    ids = tokenize_context(Path(section["attention"]["private_context"]).read_text(), AutoTokenizer.from_pretrained(model))
    unkeyed = hashlib.sha256(json.dumps({"model": model, "dp_privacy": section, "ids": ids}).encode()).hexdigest()
    _, budget = request(base + "/v1/dp/budget")
    label = budget["contexts"][0]["context"]
    assert label.startswith("private_context ") and len(label.split()[1]) == 16
    assert unkeyed[:12] not in label and unkeyed[:12] not in log_path.read_text()
    assert budget["contexts"][0]["ledger"]["releases_of_this_context"] == 1


@pytest.mark.vllm
@pytest.mark.parametrize("field,value", [
    ("echo", True), ("prompt_logprobs", 0), ("return_token_ids", True), ("cache_salt", "abc"),
    ("kv_transfer_params", {"do_remote_decode": True}),
])
def test_leaking_options_get_a_clear_400(server, field, value):
    base, model, _, _ = server
    status, reply = request(base + "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": 2, field: value})
    assert status == 400 and f"`{field}` is not allowed" in reply["error"]["message"]
    for route in ("/tokenize", "/generative_scoring", "/pooling"):
        status, _ = request(base + route, {"model": model, "prompt": PROMPT})
        assert status == 403, route


@pytest.mark.vllm
def test_sagemaker_routes_are_served_and_guarded(server):
    base, model, _, _ = server
    ping = urllib.request.Request(base + "/ping", data=b"", method="POST")
    with urllib.request.urlopen(ping, timeout=60) as response:
        assert response.status == 200
    status, done = request(base + "/invocations", {"model": model, "prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and done["usage"]["completion_tokens"] == 2
    status, reply = request(base + "/invocations", {"model": model, "prompt": PROMPT, "echo": True})
    assert status == 400 and "`echo` is not allowed" in reply["error"]["message"]
