"""Serving benchmarks: vLLM's CLI in a subprocess, a server on a free local port, ``vllm bench
serve`` against it. Nothing here imports vllm: every engine runs in its own process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

from vllm_dp_plugin.serving.memory import kv_cache_flags

LAUNCH = [sys.executable, "-m", "vllm_dp_plugin.serving.launch"]  # `vllm ...` with the CPU shim
VLLM_DP = [sys.executable, "-m", "vllm_dp_plugin.cli"]  # `vllm-dp ...`
# Every serving benchmark's engine: float32 (the CPU backend's exact path), no CUDA graphs,
# seed 0; its sequence length and KV cache (in bytes: serving.memory) from `engine_flags`.
ENGINE_FLAGS = ["--dtype", "float32", "--block-size", "32", "--enforce-eager", "--seed", "0"]
MAX_MODEL_LEN = 4096
LATENCY_KEYS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                "p99_tpot_ms", "request_throughput", "output_throughput")


def engine_flags(model: str, sequences: int, tokens: int | None = None, max_model_len: int = MAX_MODEL_LEN) -> list[str]:
    """``ENGINE_FLAGS`` with ``--max-model-len`` and a KV cache for ``sequences`` sequences of
    ``tokens`` tokens (None: ``max_model_len``) in flight at once."""
    return [*ENGINE_FLAGS, "--max-model-len", str(max_model_len),
            *kv_cache_flags(model, max_model_len, sequences, tokens=tokens)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def with_env(overrides: Mapping[str, str | None] | Sequence[tuple[str, str | None]]) -> dict:
    """This process's environment with ``overrides`` applied (a None value removes the name)."""
    env = dict(os.environ)
    for name, value in dict(overrides).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def config_env(config: str) -> dict:
    """The environment of a benchmark row: ``stock`` without vLLM plugins, ``dp_*`` with the
    dp_privacy plugin, anything else (``plugin_off``) with vLLM's default (every plugin)."""
    if config == "stock":
        return with_env({"VLLM_PLUGINS": ""})
    if config.startswith("dp_"):
        return with_env({"VLLM_PLUGINS": "dp_privacy"})
    return with_env({"VLLM_PLUGINS": None})


def run_logged(cmd: Sequence[str], env: dict, log: Path, timeout: int = 1800) -> None:
    """Run ``cmd`` with stdout and stderr to ``log``; RuntimeError with the log's tail on failure."""
    with Path(log).open("w") as handle:
        proc = subprocess.run(list(cmd), env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout,
                              check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}); see {log}:\n"
                           + Path(log).read_text()[-3000:])


class RunningServer:
    """Context manager: ``cmd --host 127.0.0.1 --port <free port>`` in its own process group
    (``env``: the full environment, None: this process's), output to ``log``; entered once
    ``/health`` answers (RuntimeError with the log's tail if the server exits or ``timeout``
    seconds pass); on exit SIGTERM to the group, SIGKILL after ``stop_timeout`` seconds."""

    def __init__(self, cmd: Sequence[str], log: Path, env: dict | None = None, timeout: float = 900,
                 stop_timeout: float = 60) -> None:
        self.cmd, self.log, self.env = list(cmd), Path(log), env
        self.timeout, self.stop_timeout = timeout, stop_timeout

    def __enter__(self) -> Self:
        self.port = free_port()
        with self.log.open("w") as handle:
            self.proc = subprocess.Popen([*self.cmd, "--host", "127.0.0.1", "--port", str(self.port)],
                                         env=self.env, stdout=handle, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + self.timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited ({self.proc.returncode}); see {self.log}:\n"
                                       + self.log.read_text()[-4000:])
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not healthy after {self.timeout:.0f} s; see {self.log}")
                try:
                    urllib.request.urlopen(self.base + "/health", timeout=2)
                    return self
                except OSError:
                    time.sleep(2)
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM to the group, then SIGKILL to whatever is left of it (after ``stop_timeout``
        seconds, or at once when the server had exited already: a server killed first leaves
        its engine core running)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone
            pass
        self.proc.wait()

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.base + path, timeout=60) as response:
            return json.loads(response.read())


def served_latency(label: str, model: str, server_flags: list[str], env: dict, dataset: list[str],
                   concurrencies: Sequence[int], num_prompts: int, work: Path, extra: dict) -> list[dict]:
    """``vllm serve model *server_flags`` (environment ``env``), then ``vllm bench serve`` on
    ``/v1/completions`` with ``dataset`` flags at each concurrency; one row per concurrency:
    ``{"config": label, **extra, "concurrency": c, <LATENCY_KEYS> (ms, req/s, tok/s)}``."""
    cmd = [*LAUNCH, "serve", model, *engine_flags(model, max(concurrencies)), *server_flags]
    with RunningServer(cmd, work / f"serve-{label}.log", env, timeout=600) as server:
        rows = []
        for concurrency in concurrencies:
            name = f"latency-{label}-c{concurrency}.json"
            bench = [*LAUNCH, "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
                     "--base-url", server.base, "--model", model,
                     "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
                     "--save-result", "--result-dir", str(work), "--result-filename", name, *dataset]
            run_logged(bench, env, work / f"{name}.log")
            data = json.loads((work / name).read_text())
            rows.append({"config": label, **extra, "concurrency": concurrency, **{k: data[k] for k in LATENCY_KEYS}})
        return rows
