"""Shared helpers of the vLLM end-to-end tests: engines in subprocesses, a demo deployment."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

ENGINE_SCRIPT = Path(__file__).with_name("dp_engine.py")
CONTEXT_TEXT = (
    "Internal memo: the launch code for project Bluebird is 7341. Do not disclose salary bands "
    "to contractors. The acquisition of Northwind closes on March 3.\n"
)


def run_engine(job: dict, vllm_plugins: str | None = "dp_privacy", env: dict | None = None) -> list[dict]:
    """Run ``dp_engine.py`` with ``job`` in a fresh process (``env``: extra variables); returns
    its per-step results."""
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1", **(env or {}))
    env.pop("VLLM_PLUGINS", None)
    if vllm_plugins is not None:
        env["VLLM_PLUGINS"] = vllm_plugins
    proc = subprocess.run(
        [sys.executable, str(ENGINE_SCRIPT), json.dumps(job)],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-2000:], proc.stderr[-6000:])
    return json.loads(lines[-1][len("RESULT "):])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def vllm_dp_server(argv: list[str], log_path: Path, timeout: float = 400):
    """``vllm-dp serve *argv`` on a free local port (output to ``log_path``), yields its base URL
    once ``/health`` answers; stops the server's process group on exit."""
    port = free_port()
    cli = str(Path(sys.executable).with_name("vllm-dp"))  # the console script of this venv
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [cli, "serve", *argv, "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, f"server did not come up in {timeout} s"
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(2)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def dp_section(tmp: Path, epsilon: float, **attention) -> dict:
    """A dp_privacy section over the demo context with absolute paths under ``tmp``."""
    context = tmp / "context.txt"
    if not context.exists():
        context.write_text(CONTEXT_TEXT)
    section = {
        "key_file": str(tmp / "noise.key"),
        "attention": {
            "epsilon": epsilon,
            "delta": 1e-6,
            "degree": 3,
            "bounds": {"key_bound": 1.5, "query_bound": 1.5, "value_bound": 2.0,
                       "key_norm": 2.5, "query_norm": 2.5},
            "private_context": str(context),
            "gate": False,  # the demo model's random weights: exercise every release (the gate's own tests set it)
            **attention,
        },
    }
    return section


def write_dp_yaml(path: Path, section: dict) -> Path:
    path.write_text(yaml.safe_dump({"dp_privacy": section}, sort_keys=False))  # as written: contexts' order
    return path
