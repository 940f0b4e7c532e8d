"""The processes of a running ``vllm-dp serve``: the API server (the launched process) and the
engine core it spawns (process title ``VLLM::EngineCore``), found through the process tree."""

from __future__ import annotations

import os
import signal
import time

import psutil

API_SERVER, ENGINE_CORE = "api-server", "engine-core"
TARGETS = (API_SERVER, ENGINE_CORE)
ENGINE_TITLE = "VLLM::EngineCore"


def engine_core(api_pid: int) -> psutil.Process:
    """The engine core among the API server's descendants (RuntimeError when there is none)."""
    for child in psutil.Process(api_pid).children(recursive=True):
        try:
            if child.name() == ENGINE_TITLE or (child.cmdline() or [""])[0].startswith(ENGINE_TITLE):
                return child
        except psutil.NoSuchProcess:
            continue
    raise RuntimeError(f"no {ENGINE_TITLE} process under the API server {api_pid}")


def victim(target: str, api_pid: int) -> int:
    """The pid ``kill -9`` hits for ``target`` (``API_SERVER`` or ``ENGINE_CORE``)."""
    if target == API_SERVER:
        return api_pid
    if target == ENGINE_CORE:
        return engine_core(api_pid).pid
    raise ValueError(f"unknown kill target {target!r}; known: {TARGETS}")


def kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def wait_exit(pid: int, timeout: float) -> float | None:
    """Seconds until ``pid`` exits (or is a zombie), None after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return time.monotonic() - start
        except psutil.NoSuchProcess:
            return time.monotonic() - start
        time.sleep(0.2)
    return None
