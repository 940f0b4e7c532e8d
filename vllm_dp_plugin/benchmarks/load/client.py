"""The load generator: concurrent OpenAI-shaped chat requests over httpx, every other one streamed,
some given up by the client part-way, each recorded as an ``Outcome``; the numbers of a run's
outcomes. A receipt (``dp_receipt``: the body's field, or the final chunk's of a stream) counts as
delivered only when the client read it; a request the client gave up on has none."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import httpx
import numpy as np

RECEIPT_FIELD = "dp_receipt"  # serving.aggregate's (not imported: that module needs vLLM's server stack)
QUESTIONS = ("Who leads the Northwind warehouse team?", "What is the capital of France?",
             "When does the Northwind office open?", "What is 7 + 5?", "Which river flows past the main office?",
             "Name a colour of the sky.")


@dataclass(frozen=True)
class RequestSpec:
    """One request: ``stream`` or not, ``cancel`` (the client gives it up: a stream after
    ``cancel_chunks`` content chunks, a plain request after ``disconnect_s`` seconds)."""

    index: int
    stream: bool
    cancel: bool
    question: str
    disconnect_s: float = 0.0


@dataclass
class Outcome:
    """What the client saw of one request: ``status`` (None: disconnected before one), ``cancelled``
    (given up, as planned), the delivered ``receipt``, ``tokens`` (``usage``, else content chunks),
    ``latency_s`` to the end or the give-up, ``ttft_s`` to a stream's first content chunk, ``error``."""

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
    """``requests`` specs, deterministic in ``seed``: every other one streamed, ``round(cancel_fraction
    * requests)`` of both kinds given up (a plain one after a uniform delay up to ``disconnect_max_s``)."""
    _check_fraction(cancel_fraction)
    rng = random.Random(seed)
    cancelled = set(rng.sample(range(requests), round(cancel_fraction * requests)))
    return [_spec(i, i in cancelled, rng, disconnect_max_s) for i in range(requests)]


def endless(cancel_fraction: float, seed: int = 0) -> Iterator[RequestSpec]:
    """Specs without end (a soak): every other one streamed, each given up with probability
    ``cancel_fraction`` (a plain one after up to 1 s)."""
    _check_fraction(cancel_fraction)
    rng = random.Random(seed)
    for i in itertools.count():
        yield _spec(i, rng.random() < cancel_fraction, rng, 1.0)


async def _read_stream(response: httpx.Response, spec: RequestSpec, out: Outcome, cancel_chunks: int) -> None:
    """Read SSE events until ``[DONE]`` (a cancelled spec: until ``cancel_chunks`` content chunks,
    then return without reading on; the caller closes the connection)."""
    chunks = 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        choice = (chunk.get("choices") or [{}])[0]
        if RECEIPT_FIELD in chunk:
            out.receipt = chunk[RECEIPT_FIELD]
        if "error" in chunk:
            out.error = "stream error event"
        if chunk.get("usage"):
            out.tokens = chunk["usage"].get("completion_tokens", out.tokens)
        if (choice.get("delta") or {}).get("content") or choice.get("text"):
            chunks += 1
            out.tokens = max(out.tokens, chunks)
            if out.ttft_s is None:
                out.ttft_s = time.perf_counter() - out.start_s
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
    """Send ``spec`` and record what came back; a cancelled stream is closed after ``cancel_chunks``
    content chunks, a cancelled plain request after ``spec.disconnect_s`` s (its status never read)."""
    url = base + "/v1/chat/completions"
    payload = {"model": model, "messages": [{"role": "user", "content": spec.question}], "max_tokens": max_tokens,
               "temperature": 0.0, "stream": spec.stream}
    if spec.stream:
        payload["stream_options"] = {"include_usage": True}
    out = Outcome(spec.index, spec.stream, spec.cancel, start_s=time.perf_counter())
    try:
        if spec.stream:
            async with client.stream("POST", url, json=payload) as response:
                out.status = response.status_code
                if response.status_code == 200:
                    await _read_stream(response, spec, out, cancel_chunks)
                else:
                    await response.aread()
        else:
            try:
                await asyncio.wait_for(_plain(client, url, payload, out), spec.disconnect_s if spec.cancel else None)
            except TimeoutError:
                out.cancelled = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = type(exc).__name__
    out.latency_s = time.perf_counter() - out.start_s
    return out


async def run(base: str, specs: Iterable[RequestSpec], model: str, max_tokens: int, concurrency: int,
              cancel_chunks: int = 1, timeout_s: float = 600.0, deadline: float | None = None,
              on_done: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """``specs`` sent by ``concurrency`` clients, each the next when its last ends, until they run out
    or ``time.perf_counter()`` passes ``deadline``; outcomes in spec order (``on_done`` sees each)."""
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

    # one connection per client at most (a cancelled request's connection is dropped, not reused)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return sorted(outcomes, key=lambda o: o.index)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values`` (numpy's: linear), None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def latency_summary(seconds: Sequence[float]) -> dict:
    """``{"n", "p50_ms", "p99_ms", "mean_ms", "max_ms"}`` of latencies in seconds (None: no latencies)."""
    ms = [s * 1e3 for s in seconds]
    return {"n": len(ms), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
            "mean_ms": sum(ms) / len(ms) if ms else None, "max_ms": max(ms) if ms else None}


def histogram(labels: Iterable[object]) -> dict[str, int]:
    """How often each label occurs, keys as strings, sorted."""
    return {str(k): v for k, v in sorted(Counter(str(x) for x in labels).items())}


def statuses(outcomes: Iterable[Outcome]) -> dict[str, int]:
    """The status codes of outcomes (``disconnected``: given up before a status)."""
    return histogram("disconnected" if o.status is None else o.status for o in outcomes)


def outcome_row(outcomes: Sequence[Outcome], wall_s: float) -> dict:
    """Throughput, latency, TTFT and status codes of one mode's outcomes."""
    done = [o for o in outcomes if o.completed]
    answered_end = max((o.start_s + o.latency_s for o in done), default=None)
    span = None if answered_end is None else answered_end - min(o.start_s for o in outcomes)
    tokens = sum(o.tokens for o in done)
    return {
        "requests": len(outcomes), "wall_s": wall_s, "status": statuses(outcomes),
        "streamed": sum(o.stream for o in outcomes), "cancelled": sum(o.cancelled for o in outcomes),
        "errors": histogram(o.error for o in outcomes if o.error),
        "completed": len(done), "completion_tokens": tokens,
        "requests_per_s": len(outcomes) / wall_s, "completed_per_s": len(done) / wall_s,
        "tokens_per_s": tokens / wall_s, "answered_span_s": span,
        "answered_per_s_in_span": None if span is None else len(done) / max(span, 1e-9),
        "latency": {"completed": latency_summary([o.latency_s for o in done]),
                    "completed_stream": latency_summary([o.latency_s for o in done if o.stream]),
                    "completed_plain": latency_summary([o.latency_s for o in done if not o.stream]),
                    "refused_429": latency_summary([o.latency_s for o in outcomes if o.status == 429])},
        "ttft": latency_summary([o.ttft_s for o in outcomes if o.ttft_s is not None]),
    }
