"""The load generator: concurrent OpenAI-shaped chat requests over httpx, half of them streamed,
some given up by the client part-way (a stream closed after its first content chunk(s), a plain
request's connection closed after a delay), each recorded as an ``Outcome``.

A receipt (``dp_receipt``: the body's field, or the final chunk's of a stream) counts as
delivered only when the client read it; a request the client gave up on has none."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import httpx

RECEIPT_FIELD = "dp_receipt"  # serving.aggregate's (not imported: that module needs vLLM's server stack)
QUESTIONS = (
    "Who leads the Northwind warehouse team?",
    "What is the capital of France?",
    "When does the Northwind office open?",
    "What is 7 + 5?",
    "Which river flows past the main office?",
    "Name a colour of the sky.",
)


@dataclass(frozen=True)
class RequestSpec:
    """One request of a run: ``stream`` or not, ``cancel`` (the client gives it up: a stream
    after ``cancel_chunks`` content chunks, a plain request after ``disconnect_s`` seconds)."""

    index: int
    stream: bool
    cancel: bool
    question: str
    disconnect_s: float = 0.0


@dataclass
class Outcome:
    """What the client saw of one request. ``status`` None: the client disconnected before a
    status line arrived; ``cancelled``: it gave the request up (as planned); ``receipt``: the
    delivered ``dp_receipt`` (None if not delivered); ``tokens``: completion tokens (``usage``,
    else content chunks read); ``latency_s`` to the end (or the give-up), ``ttft_s`` to the first
    content chunk of a stream; ``error``: a transport error's type."""

    index: int
    stream: bool
    cancel: bool
    start_s: float = 0.0
    status: int | None = None
    cancelled: bool = False
    latency_s: float = 0.0
    ttft_s: float | None = None
    tokens: int = 0
    receipt: dict | None = None
    error: str | None = None

    @property
    def completed(self) -> bool:
        """Answered in full: status 200 and not given up."""
        return self.status == 200 and not self.cancelled and self.error is None


def _spec(index: int, cancel: bool, rng: random.Random, disconnect_max_s: float) -> RequestSpec:
    return RequestSpec(index, index % 2 == 0, cancel, QUESTIONS[index % len(QUESTIONS)],
                       rng.uniform(0.0, disconnect_max_s) if cancel else 0.0)


def _check_fraction(cancel_fraction: float) -> None:
    if not 0.0 <= cancel_fraction <= 1.0:
        raise ValueError(f"cancel_fraction must lie in [0, 1], got {cancel_fraction!r}")


def plan(requests: int, cancel_fraction: float, seed: int = 0, disconnect_max_s: float = 1.0) -> list[RequestSpec]:
    """``requests`` specs, deterministic in ``seed``: every other one streamed (half each),
    ``round(cancel_fraction * requests)`` of them, spread at random over both kinds, given up by
    the client (a plain one after a uniform delay in ``[0, disconnect_max_s]``)."""
    _check_fraction(cancel_fraction)
    rng = random.Random(seed)
    cancelled = set(rng.sample(range(requests), round(cancel_fraction * requests)))
    return [_spec(i, i in cancelled, rng, disconnect_max_s) for i in range(requests)]


def endless(cancel_fraction: float, seed: int = 0, disconnect_max_s: float = 1.0) -> Iterator[RequestSpec]:
    """Specs without end (a soak): every other one streamed, each given up with probability
    ``cancel_fraction``."""
    _check_fraction(cancel_fraction)
    rng = random.Random(seed)
    for i in itertools.count():
        yield _spec(i, rng.random() < cancel_fraction, rng, disconnect_max_s)


def body(spec: RequestSpec, model: str, max_tokens: int) -> dict:
    payload = {"model": model, "messages": [{"role": "user", "content": spec.question}], "max_tokens": max_tokens,
               "temperature": 0.0, "stream": spec.stream}
    if spec.stream:
        payload["stream_options"] = {"include_usage": True}
    return payload


def _content(chunk: dict) -> str:
    choices = chunk.get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or choices[0].get("text") or ""


async def _read_stream(response: httpx.Response, spec: RequestSpec, out: Outcome, start: float,
                       cancel_chunks: int) -> None:
    """Read SSE events until ``[DONE]`` (or, for a cancelled spec, ``cancel_chunks`` content
    chunks: then return without reading on, and the caller closes the connection)."""
    chunks = 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if RECEIPT_FIELD in chunk:
            out.receipt = chunk[RECEIPT_FIELD]
        if "error" in chunk:
            out.error = "stream error event"
        usage = chunk.get("usage")
        if usage:
            out.tokens = usage.get("completion_tokens", out.tokens)
        if _content(chunk):
            chunks += 1
            out.tokens = max(out.tokens, chunks)
            if out.ttft_s is None:
                out.ttft_s = time.perf_counter() - start
            if spec.cancel and chunks >= cancel_chunks:
                out.cancelled = True
                return


async def _plain(client: httpx.AsyncClient, url: str, payload: dict, out: Outcome) -> None:
    response = await client.post(url, json=payload)
    out.status = response.status_code
    if response.status_code == 200:
        data = response.json()
        out.receipt = data.get(RECEIPT_FIELD)
        out.tokens = (data.get("usage") or {}).get("completion_tokens", 0)


async def one(client: httpx.AsyncClient, base: str, spec: RequestSpec, model: str, max_tokens: int,
              cancel_chunks: int = 1) -> Outcome:
    """Send ``spec`` and record what came back; a cancelled stream's connection is closed after
    ``cancel_chunks`` content chunks (leaving the ``stream`` block unread closes it), a cancelled
    plain request's after ``spec.disconnect_s`` seconds (the task is cancelled: its connection
    is closed, the status is never read)."""
    url, payload = base + "/v1/chat/completions", body(spec, model, max_tokens)
    out = Outcome(spec.index, spec.stream, spec.cancel)
    start = time.perf_counter()
    out.start_s = start
    try:
        if spec.stream:
            async with client.stream("POST", url, json=payload) as response:
                out.status = response.status_code
                if response.status_code == 200:
                    await _read_stream(response, spec, out, start, cancel_chunks)
                else:
                    await response.aread()
        elif spec.cancel:
            try:
                await asyncio.wait_for(_plain(client, url, payload, out), spec.disconnect_s)
            except TimeoutError:
                out.cancelled = True
        else:
            await _plain(client, url, payload, out)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = type(exc).__name__
    out.latency_s = time.perf_counter() - start
    return out


def new_client(concurrency: int, timeout_s: float) -> httpx.AsyncClient:
    """One connection per client at most (a cancelled request's connection is dropped, not reused)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s))


async def run(base: str, specs: Iterable[RequestSpec], model: str, max_tokens: int, concurrency: int,
              cancel_chunks: int = 1, timeout_s: float = 600.0, deadline: float | None = None,
              on_done: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """``specs`` sent by ``concurrency`` clients (each sends the next spec when its last one
    ends) until they run out or ``time.perf_counter()`` passes ``deadline``; outcomes in spec
    order. ``on_done`` sees each outcome as it ends."""
    pending = iter(specs)
    outcomes: list[Outcome] = []

    async def worker(client: httpx.AsyncClient) -> None:
        for spec in pending:  # one iterator shared by the workers (one event loop: no race)
            outcome = await one(client, base, spec, model, max_tokens, cancel_chunks)
            outcomes.append(outcome)
            if on_done is not None:
                on_done(outcome)
            if deadline is not None and time.perf_counter() >= deadline:
                return

    async with new_client(concurrency, timeout_s) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return sorted(outcomes, key=lambda o: o.index)
